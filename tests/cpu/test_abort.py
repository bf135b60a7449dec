"""A client that drops a stream aborts its engine request; other streams go on."""

from __future__ import annotations

import threading
import time

from tests.cpu.conftest import MAX_MODEL_LEN, MODEL

# Long enough that neither stream can end on its own while the disconnect travels to the engine.
DROPPED_TOKENS = MAX_MODEL_LEN - 100
CONTROL_TOKENS = MAX_MODEL_LEN - 1000


def engine_unfinished(llm_handle) -> int:
    """Requests the engine itself still holds (vLLM's output processor), not what the client infers."""
    return llm_handle.stats.remote().result()["num_unfinished_requests"]


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def serve_log_lines(cluster, needle: str) -> str:
    """Lines of the cluster's Serve logs (proxy, ingress, replicas) that mention `needle`: the failure's story."""
    lines = []
    for path in sorted((cluster.temp_dir / "session_latest/logs/serve").glob("*.log")):
        lines += [f"{path.name}: {line}" for line in path.read_text(errors="replace").splitlines() if needle in line]
    return "\n".join(lines[-40:])


class EngineWatch:
    """Polls the engine's request count, keeping what it saw (seconds since the watch began, count) for failures."""

    def __init__(self, llm_handle):
        self._handle = llm_handle
        self._t0 = time.monotonic()
        self.seen: list[tuple[float, int]] = []

    def reaches(self, count: int, timeout_s: float) -> bool:
        def check() -> bool:
            self.seen.append((round(time.monotonic() - self._t0, 1), engine_unfinished(self._handle)))
            return self.seen[-1][1] == count
        return wait_for(check, timeout_s)

    def story(self) -> str:
        changes = [s for i, s in enumerate(self.seen) if i == 0 or s[1] != self.seen[i - 1][1]]
        return f"engine request counts (s, count) where they changed: {changes}; last: {self.seen[-1:]}"


def test_client_disconnect_aborts_engine_request(client, llm_handle, summit):
    assert wait_for(lambda: engine_unfinished(llm_handle) == 0, 30)

    control: dict = {}

    def run_control():
        stream = client.completions.create(model=MODEL, prompt="Control", max_tokens=CONTROL_TOKENS, stream=True,
                                           extra_body={"ignore_eos": True})
        control["chunks"] = list(stream)

    watch = EngineWatch(llm_handle)
    dropped_id = f"abort-test-{time.time_ns()}"
    dropped = client.completions.create(model=MODEL, prompt="Dropped", max_tokens=DROPPED_TOKENS, stream=True,
                                        extra_body={"ignore_eos": True}, extra_headers={"x-request-id": dropped_id})
    for _, _ in zip(range(3), dropped):
        pass
    thread = threading.Thread(target=run_control)
    thread.start()

    def story() -> str:
        return (f"{watch.story()}; control stream running: {thread.is_alive()}; "
                f"Serve log lines for the dropped request:\n{serve_log_lines(summit, dropped_id)}")

    assert watch.reaches(2, 30), f"both requests should be in the engine; {story()}"

    dropped.close()  # the client goes away mid-stream
    # generous: on a loaded 2-core box the disconnect crosses proxy -> ingress -> replica -> engine slowly
    assert watch.reaches(1, 60), f"the dropped request was not aborted; {story()}"
    assert thread.is_alive(), f"the control stream should still be running when the abort lands; {story()}"
    # the replica says so in its Serve log (what the dashboard shows), after vLLM's start-up reconfigured logging
    def replica_logged_cancel() -> bool:
        lines = serve_log_lines(summit, dropped_id).splitlines()
        return any("LLMServer" in line and "cancelled by its caller" in line for line in lines)

    assert wait_for(replica_logged_cancel, 10), story()

    thread.join(300)
    chunks = control["chunks"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 100
    # the dropped request would outlive the control one (fewer tokens) had it not been aborted
    assert watch.reaches(0, 5), story()

