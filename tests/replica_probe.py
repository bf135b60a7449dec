"""Ask each replica of a Serve deployment for something, or kill one, from a short-lived Ray driver.

Serve handles cannot address a replica, so `call_each_replica` calls the method through the deployment's own
handle until the given number of distinct replicas have answered (the method's result names its replica, as
`LLMServer.stats()` and `prefix_cache_stats()` do). Calls carry no HTTP request, so the affinity routers route
them by load alone: on idle replicas that is a coin toss per call.

Tests and benchmarks run it as a subprocess (`probe(address, ...)`): one Python process can be the Ray driver
of one cluster only, and the CPU suite's session cluster may hold the test process's.

    python -m tests.replica_probe --address 127.0.0.1:6379 each summit LLMServer:tiny prefix_cache_stats --replicas 2
    python -m tests.replica_probe --address 127.0.0.1:6379 kill summit LLMServer:tiny REPLICA_ID
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.local_cluster import loopback_env

REPO = Path(__file__).resolve().parents[1]


def call_each_replica(
    app_name: str, deployment: str, method: str, replicas: int, attempts: int = 200, args: tuple = ()
) -> dict[str, Any]:
    """{replica_id: result} once `replicas` distinct replicas answered `method` (RuntimeError after `attempts`
    calls)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app_name)
    answers: dict[str, Any] = {}
    for _ in range(attempts):
        result = getattr(handle, method).remote(*args).result(timeout_s=60)
        answers[result["replica_id"]] = result
        if len(answers) >= replicas:
            return answers
    raise RuntimeError(f"only {len(answers)} of {replicas} replicas of {deployment} answered in {attempts} calls")


def kill_replica(app_name: str, deployment: str, replica_id: str) -> str:
    """`ray.kill` the replica actor (no restart: Serve notices and replaces it); returns the actor's name."""
    import ray

    suffix = f"::{app_name}#{deployment}#{replica_id}"  # Serve names replica actors SERVE_REPLICA::app#deployment#id
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "serve" and actor["name"].endswith(suffix):
            ray.kill(ray.get_actor(actor["name"], namespace="serve"), no_restart=True)
            return actor["name"]
    raise LookupError(f"no Serve replica actor named *{suffix}")


def probe(address: str, *args: str, timeout_s: float = 180) -> Any:
    """Run this module as a subprocess driver of the cluster at `address`; returns its JSON answer."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.replica_probe", "--address", address, *args],
        cwd=REPO,
        env=loopback_env({"PYTHONPATH": str(REPO)}),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if out.returncode != 0:
        raise RuntimeError(f"replica_probe {' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, help="the cluster's GCS address")
    sub = p.add_subparsers(dest="command", required=True)
    each = sub.add_parser("each", help="call METHOD on each replica")
    each.add_argument("app")
    each.add_argument("deployment")
    each.add_argument("method")
    each.add_argument("--replicas", type=int, required=True)
    each.add_argument("args", nargs="*", help="the method's arguments (strings)")
    kill = sub.add_parser("kill", help="kill one replica actor")
    kill.add_argument("app")
    kill.add_argument("deployment")
    kill.add_argument("replica_id")
    ns = p.parse_args(argv)

    import ray

    ray.init(address=ns.address, logging_level="ERROR", log_to_driver=False)
    try:
        if ns.command == "each":
            answer: Any = call_each_replica(ns.app, ns.deployment, ns.method, ns.replicas, args=tuple(ns.args))
        else:
            answer = kill_replica(ns.app, ns.deployment, ns.replica_id)
    finally:
        ray.shutdown()
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
