"""A dead engine: the client gets a clean error, Serve replaces the replica, the next request succeeds (direct path;
the two-hop path's case is in test_disaggregation.py's fallback test).

Named to run last: it restarts the session's only replica.
"""

from __future__ import annotations

import os
import time

from deployments.engine.platform import SPIN_ENV, SPIN_SLEEP_ENV
from tests.conftest import TEST_CLUSTER_ENV
from tests.cpu.conftest import MODEL
from tests.cpu.engine_apps import REPO, wait_for
from tests.engine_checks import (
    assert_workers_forked_by_the_core,
    kill_engine_and_wait_for_answers,
    mp_workers,
    runnable_share,
)


def test_an_idle_engines_worker_sleeps_where_its_spin_is_short(client, engine_stats):
    """vLLM's workers spin on their shared-memory queue for 1 s after each read (a core each, between requests); the
    test clusters' engines spin SUMMIT_ENGINE_SPIN_S (0.1 s, tests/conftest.py; deployments/engine/platform.py). From
    0.4 s after an answer for 0.4 s, a worker spinning vLLM's 1 s would be runnable in nearly every sample (measured:
    with SUMMIT_ENGINE_SPIN_S=1, 1.0)."""
    assert float(os.environ[SPIN_ENV]) < 0.4
    workers = mp_workers({"pid": engine_stats()["pid"]})
    assert workers
    shares = []
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="The ridge", max_tokens=4)
        time.sleep(0.4)
        shares.append(runnable_share(workers))
    print("worker runnable share 0.4-0.8 s after an answer:", shares)
    assert min(shares) < 0.5, shares


def _voluntary_switches(proc) -> int:
    """How often the process's main thread gave up its CPU to wait (a sleep, a blocking read): `sched_yield` is not
    one."""
    for line in open(f"/proc/{proc.pid}/task/{proc.pid}/status"):
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches for {proc.pid}")


def test_a_cpu_engines_worker_sleeps_between_polls_while_it_generates(client, engine_stats):
    """A CPU engine's spinners sleep between polls of vLLM's queue instead of yielding (deployments/engine/platform.py:
    shm_spinners_sleep, on by default for CPU engines): while the worker generates 64 tokens it waits for each next
    step, and each of those waits is a sleep, a voluntary switch. A worker that yields (vLLM's own, or
    SUMMIT_ENGINE_SPIN_SLEEP_US=0) makes none while it spins: its whole life of yields counted 16 once (measured)."""
    shipped = (REPO / "serve_configs/tiny-cpu.yaml").read_text()
    assert SPIN_SLEEP_ENV not in shipped and SPIN_SLEEP_ENV not in TEST_CLUSTER_ENV  # the default, not a setting
    workers = mp_workers({"pid": engine_stats()["pid"]})
    assert workers
    before = [_voluntary_switches(w) for w in workers]
    answer = client.completions.create(model=MODEL, prompt="The ridge", max_tokens=64, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 64
    slept = [_voluntary_switches(w) - b for w, b in zip(workers, before)]
    print("worker voluntary switches during 64 tokens:", slept)
    assert min(slept) >= 32, slept


def test_killed_engine_is_replaced(summit, engine_stats):
    before = engine_stats()
    assert_workers_forked_by_the_core(before["pid"])  # the engine started without a second interpreter start
    kill_engine_and_wait_for_answers(summit.base_url, MODEL, before["pid"], before["replica_id"])
    after: dict = {}

    def replaced() -> bool:
        try:  # the probe's handle may not know the new replica yet: "DeploymentUnavailableError" until it does
            after.update(engine_stats())
        except RuntimeError:
            return False
        return after["replica_id"] != before["replica_id"]

    assert wait_for(replaced, 120, 2), after
    assert after["pid"] != before["pid"]
