"""A dead engine: the client gets a clean error, Serve replaces the replica, the next request succeeds (direct path;
the two-hop path's case is in test_disaggregation.py's fallback test).

Named to run last: it restarts the session's only replica.
"""

from __future__ import annotations

from tests.cpu.conftest import MODEL
from tests.cpu.engine_apps import wait_for
from tests.engine_checks import assert_workers_forked_by_the_core, kill_engine_and_wait_for_answers


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
