"""A dead engine: the client gets a clean error, Serve replaces the replica, the next request succeeds.

Named to run last: it restarts the session's only replica.
"""

from __future__ import annotations

import time

import httpx
import psutil

from tests.cpu.conftest import MODEL


def engine_core_processes(replica_pid: int) -> list[psutil.Process]:
    children = psutil.Process(replica_pid).children(recursive=True)
    return [p for p in children if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]


def test_killed_engine_is_replaced(summit, llm_handle):
    before = llm_handle.stats.remote().result()
    cores = engine_core_processes(before["pid"])
    assert cores, "the replica should own a vLLM EngineCore process"
    for proc in cores:
        proc.kill()

    body = {"model": MODEL, "prompt": "after the crash", "max_tokens": 4, "ignore_eos": True}
    errors, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        r = httpx.post(summit.base_url + "/v1/completions", json=body, timeout=60)
        if r.status_code == 200:
            break
        errors.append(r)
        time.sleep(1)
    else:
        raise AssertionError(f"no successful request within 300 s; last: {errors[-1].status_code} {errors[-1].text}")

    assert errors, "requests right after the crash should fail cleanly, not succeed on a dead engine"
    for failed in errors:
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["type"] == "ServiceUnavailableError"
        assert failed.headers["retry-after"] and "Traceback" not in failed.text
    assert r.json()["usage"]["completion_tokens"] == 4
    after = llm_handle.stats.remote().result()
    assert after["replica_id"] != before["replica_id"] and after["pid"] != before["pid"]
