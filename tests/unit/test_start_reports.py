"""A start that cannot succeed, at unit level: the replica's report (the root cause read from its engine's output, not
vLLM's wrapper), the control plane's verdict on Serve's status (a failure another attempt would repeat ends the wait
at once; a killed engine is tried again), the wait that names a hanging replica's last line, the port check, the
bounded attempts and the SLURM job's API key. The real-engine twins are tests/cpu/test_start_failures.py,
tests/cpu/test_serve_command.py and tests/cpu/test_slurm.py.

`FakeDashboard` is a fake: it answers with the dicts Ray's `/api/serve/applications/` returns (the keys read)."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import yaml

from app.build.options import llm_deployment_options
from app.clusters import ready
from app.clusters.job_env import job_exports
from app.clusters.local_serve import port_holder
from app.clusters.serve_status import verdict
from app.config import ModelConfig
from deployments import engine
from deployments.server.startup import said_why

WRAPPER = "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
KV_LINE = (
    "ValueError: To serve at least one request with the models's max seq len (4096), (0.5 GiB KV cache is needed, "
    "which is larger than the available KV cache memory (0.25 GiB). Try increasing `gpu_memory_utilization`"
)


def failed_start(error: BaseException, lines: list[str], log) -> engine.StartFailure:
    """The replica's start raising `error` after its engine's processes wrote `lines` to its log file `log`."""
    output = engine.OutputMark()
    output.files = [(str(log), 0)]  # the replica's worker-*.err, as marked when the start began
    with pytest.raises(engine.EngineStartFailed) as raised:
        with said_why("tiny-llama", output):
            log.write_text("".join(f"{line}\n" for line in lines))
            raise error
    return raised.value.failure


def test_the_report_says_the_engines_root_cause_not_vllms_wrapper(tmp_path):
    lines = [
        "INFO 12-07 05:16:20 [core.py:90] Initializing a V1 LLM engine",
        "(EngineCore pid=12) ERROR 12-07 05:16:25 [core.py:1510] EngineCore failed to start.",
        "(EngineCore pid=12) ERROR 12-07 05:16:25 [core.py:1510] Traceback (most recent call last):",
        f"(EngineCore pid=12) ERROR 12-07 05:16:25 [core.py:1510] {KV_LINE}",
        "(Worker pid=13) BrokenPipeError: [Errno 32] Broken pipe",
    ]
    failure = failed_start(RuntimeError(WRAPPER), lines, tmp_path / "worker-1.err")
    assert failure.reason == KV_LINE and failure.kind == "kv_cache" and not failure.retry, failure
    assert "max_model_len" in failure.fix and failure.log.endswith("worker-1.err"), failure
    assert engine.StartFailure.from_text(f"Serve: replica failed\n{failure.message()}") == failure


def test_an_engine_killed_while_loading_is_said_as_its_signal_and_may_be_tried_again(tmp_path):
    error = RuntimeError("Engine core initialization failed. Failed core proc(s): {'EngineCore': -9}")
    failure = failed_start(error, ["(Worker pid=13) BrokenPipeError: [Errno 32] Broken pipe"], tmp_path / "w.err")
    assert (failure.kind, failure.retry) == ("killed", True), failure
    assert "SIGKILL" in failure.reason and "memory" in failure.fix, failure


def apps_with(message: str, status: str = "DEPLOYING", replicas: list[dict] | None = None) -> dict:
    deployment = {"status": "DEPLOYING", "message": message, "replicas": replicas or []}
    return {"app": {"status": status, "message": "", "deployments": {"LLMServer:tiny-llama": deployment}}}


def record(kind: str, retry: bool) -> str:
    return engine.StartFailure("tiny-llama", kind, f"{kind} said by the engine", "fix", retry).message()


def test_a_failure_another_attempt_would_repeat_ends_the_wait_while_serve_still_retries():
    config_error = verdict(apps_with(record("weights", retry=False)), ["app"])
    assert config_error.state == "failed" and "weights said by the engine" in config_error.reason, config_error
    killed = verdict(apps_with(record("killed", retry=True)), ["app"])
    assert killed.state == "starting", killed  # Serve tries a killed engine again
    final = verdict(apps_with(record("killed", retry=True), status="DEPLOY_FAILED"), ["app"])
    assert final.state == "failed" and final.failure.kind == "killed", final  # ... until its attempts are spent
    assert verdict({"app": {"status": "RUNNING", "deployments": {}}}, ["app"]).state == "running"


def test_a_failure_of_the_config_a_redeploy_replaced_does_not_end_the_wait():
    """`serve deploy` of a fixed YAML right after a failed one: until Serve's message catches up it still holds the old
    replica's record. A record from a replica that began before the application's last deploy is not this deploy's
    failure (seen in a fresh-clone run: the next case's wait-ready reported the previous case's error); one that
    began after it is, and once Serve fails the application its record stands whatever its time."""

    def at(began: float, status: str = "DEPLOYING") -> dict:
        message = engine.StartFailure("tiny-llama", "weights", "the old one", "fix", False, began=began).message()
        apps = apps_with(message, status=status)
        apps["app"]["last_deployed_time_s"] = 1000.0
        return apps

    assert verdict(at(990.0), ["app"]).state == "starting"  # the replaced config's replica
    assert verdict(at(1003.0), ["app"]).state == "failed"  # this deploy's
    assert verdict(at(990.0, status="DEPLOY_FAILED"), ["app"]).state == "failed"


class FakeDashboard:
    """A fake of Ray's dashboard: Serve's applications as given, and what each replica's process wrote."""

    def __init__(self, apps: dict, output: dict[str, list[str]] | None = None):
        self.apps, self.output = apps, output or {}

    def applications(self) -> dict:
        return self.apps

    def actor_output(self, actor_id: str, lines: int = 40) -> list[str]:
        return self.output.get(actor_id, [])


def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_wait_ready_ends_on_serves_failure_before_its_timeout():
    board = FakeDashboard(apps_with(record("architecture", retry=False)))
    outcome = ready.wait_ready(closed_url(), timeout_s=3, interval_s=0.05, dashboard=lambda: board, names=["app"])
    assert outcome.state == "failed" and outcome.verdict.failure.kind == "architecture", outcome


def test_a_replica_that_hangs_is_named_with_the_last_line_its_engine_wrote():
    replica = {"replica_id": "r1", "state": "STARTING", "actor_id": "a1"}
    lines = ["INFO Loading weights", "INFO Loading safetensors checkpoint shards: 3/30"]
    board = FakeDashboard(apps_with("Deploying", replicas=[replica]), {"a1": lines})
    outcome = ready.wait_ready(closed_url(), timeout_s=0.3, interval_s=0.05, dashboard=lambda: board, names=["app"])
    assert outcome.state == "timeout", outcome
    assert outcome.last_logged == [f"LLMServer:tiny-llama replica r1 last logged: {lines[-1]}"], outcome


def test_a_taken_http_port_is_named_with_its_holder():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        holder = port_holder("127.0.0.1", port)
        assert holder is not None and (holder.startswith(f"PID {os.getpid()} ") or holder == "another process")
    assert port_holder("127.0.0.1", port) is None


def test_a_replica_that_fails_to_start_is_tried_max_start_attempts_times():
    base = {"name": "m", "source": "/models/m"}
    assert llm_deployment_options(ModelConfig(**base)).get("max_constructor_retry_count") == 3
    attempts = ModelConfig(**base, deployment={"max_start_attempts": 1})
    assert llm_deployment_options(attempts).get("max_constructor_retry_count") == 1


def test_a_slurm_jobs_api_is_on_a_key_only_its_user_reads_unless_the_yaml_has_auth(tmp_path):
    app = {"name": "app", "import_path": "app.build:build_app", "args": {"models": [{"name": "m", "source": "/m"}]}}
    config = tmp_path / "serve.yaml"
    (tmp_path / "job").mkdir(), (tmp_path / "job2").mkdir()
    config.write_text(yaml.safe_dump({"applications": [app]}))
    env = job_exports(tmp_path / "state", config, tmp_path / "job" / "serve.yaml")
    key = tmp_path / "job" / "api_key"
    assert env["SUMMIT_API_KEY_FILE"] == str(key) and stat.S_IMODE(key.stat().st_mode) == 0o600, env
    job = yaml.safe_load((tmp_path / "job" / "serve.yaml").read_text())
    assert job["applications"][0]["args"]["auth"] == {"api_keys_file": str(key)}
    own = {**app, "args": {**app["args"], "auth": {"api_keys_env": "SITE_KEYS"}}}
    config.write_text(yaml.safe_dump({"applications": [own]}))
    env = job_exports(tmp_path / "state2", config, tmp_path / "job2" / "serve.yaml")
    job = yaml.safe_load((tmp_path / "job2" / "serve.yaml").read_text())
    assert env["SUMMIT_API_KEY_FILE"] == "" and job["applications"][0]["args"]["auth"] == {"api_keys_env": "SITE_KEYS"}
