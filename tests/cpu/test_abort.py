"""A client that drops a stream aborts its engine request; other streams go on."""

from __future__ import annotations

import threading
import time

from tests.cpu.conftest import MODEL


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


def test_client_disconnect_aborts_engine_request(client, llm_handle):
    assert wait_for(lambda: engine_unfinished(llm_handle) == 0, 30)

    control: dict = {}

    def run_control():
        stream = client.completions.create(model=MODEL, prompt="Control", max_tokens=1500, stream=True,
                                           extra_body={"ignore_eos": True})
        control["chunks"] = list(stream)

    dropped = client.completions.create(model=MODEL, prompt="Dropped", max_tokens=1900, stream=True,
                                        extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), dropped):
        pass
    thread = threading.Thread(target=run_control)
    thread.start()
    assert wait_for(lambda: engine_unfinished(llm_handle) == 2, 30), "both requests should be in the engine"

    dropped.close()  # the client goes away mid-stream
    # generous: on a loaded 2-core box the disconnect crosses proxy -> ingress -> replica -> engine slowly
    assert wait_for(lambda: engine_unfinished(llm_handle) == 1, 60), "the dropped request was not aborted"
    assert thread.is_alive(), "the control stream should still be running when the abort lands"

    thread.join(300)
    chunks = control["chunks"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 100
    # the dropped request (1,900 tokens) would outlive the control one (1,500) had it not been aborted
    assert wait_for(lambda: engine_unfinished(llm_handle) == 0, 5)
