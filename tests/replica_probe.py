"""Ask each replica of a Serve deployment for something, or kill one, from a short-lived Ray driver.

Serve handles cannot address a replica, so `call_each_replica` calls the method through the deployment's own
handle until the given number of distinct replicas have answered (the method's result names its replica, as
`LLMServer.stats()` and `prefix_cache_stats()` do). Calls carry no HTTP request, so the affinity routers route
them by load alone: on idle replicas that is a coin toss per call.

Tests and benchmarks run it as a subprocess (`probe(address, ...)`): one Python process can be the Ray driver
of one cluster only, and the CPU suite's session cluster may hold the test process's. The subprocess stays up, one per
cluster, and answers one request per line (a Ray driver takes 2-4 s to start on 2 cores, and tests poll through it);
`stop_probes(address)` (LocalCluster.stop) ends it.

    python -m tests.replica_probe --address 127.0.0.1:6379 each summit LLMServer:tiny prefix_cache_stats --replicas 2
    python -m tests.replica_probe --address 127.0.0.1:6379 call summit LLMServer:tiny REPLICA_ID move_streams
    python -m tests.replica_probe --address 127.0.0.1:6379 kill summit LLMServer:tiny REPLICA_ID
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from tests.local_cluster import loopback_env

REPO = Path(__file__).resolve().parents[1]


_HANDLES: dict[tuple[str, str], Any] = {}  # a serving driver's handles, one router each


def call_each_replica(
    app_name: str,
    deployment: str,
    method: str,
    replicas: int,
    attempts: int = 200,
    args: tuple = (),
    kwargs: dict | None = None,
) -> dict[str, Any]:
    """{replica_id: result} once `replicas` distinct replicas answered `method` (RuntimeError after `attempts`
    calls)."""
    from ray import serve

    key = (app_name, deployment)
    handle = _HANDLES.get(key) or _HANDLES.setdefault(key, serve.get_deployment_handle(deployment, app_name=app_name))
    answers: dict[str, Any] = {}
    for _ in range(attempts):
        call = getattr(handle, method).remote(*args, **(kwargs or {}))
        result = call.result(timeout_s=120)  # a new router on a loaded box
        answers[result["replica_id"]] = result
        if len(answers) >= replicas:
            return answers
    raise RuntimeError(f"only {len(answers)} of {replicas} replicas of {deployment} answered in {attempts} calls")


def _replica_actor(app_name: str, deployment: str, replica_id: str):
    import ray

    suffix = f"::{app_name}#{deployment}#{replica_id}"  # Serve names replica actors SERVE_REPLICA::app#deployment#id
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "serve" and actor["name"].endswith(suffix):
            return ray.get_actor(actor["name"], namespace="serve"), actor["name"]
    raise LookupError(f"no Serve replica actor named *{suffix}")


def call_replica(app_name: str, deployment: str, replica_id: str, method: str, args: tuple, kwargs: dict) -> Any:
    """`method` of one replica (by its id), through its actor as Serve's own handles call it (a RequestMetadata
    naming the method): a handle would let the deployment's router pick the replica."""
    import pickle
    import uuid

    import ray
    from ray.serve._private.common import RequestMetadata

    actor, _ = _replica_actor(app_name, deployment, replica_id)
    rid = uuid.uuid4().hex
    metadata = RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method, app_name=app_name)
    return ray.get(actor.handle_request.remote(pickle.dumps(metadata), *args, **kwargs), timeout=120)


def kill_replica(app_name: str, deployment: str, replica_id: str) -> str:
    """`ray.kill` the replica actor (no restart: Serve notices and replaces it); returns the actor's name."""
    import ray

    actor, name = _replica_actor(app_name, deployment, replica_id)
    ray.kill(actor, no_restart=True)
    return name


_DRIVERS: dict[str, subprocess.Popen] = {}


def probe(address: str, *args: str, timeout_s: float = 180) -> Any:
    """Ask the cluster at `address` through this module's driver subprocess (started on first use); its JSON answer.
    RuntimeError with the driver's error; subprocess.TimeoutExpired (the driver killed) after `timeout_s`."""
    reply = _ask(address, args, timeout_s)
    if "DeploymentUnavailableError" in reply.get("error", ""):
        # the driver's Serve router of a deployment whose application was shut down and deployed again stays
        # unavailable for the life of that process: a new driver finds the new application
        stop_probes(address)
        reply = _ask(address, args, timeout_s)
    if "error" in reply:
        raise RuntimeError(f"replica_probe {' '.join(args)} failed: {reply['error']}")
    return reply["answer"]


def _ask(address: str, args: tuple[str, ...], timeout_s: float) -> dict:
    """One question to the driver subprocess of `address` (started when there is none); its reply."""
    driver = _DRIVERS.get(address)
    if driver is None or driver.poll() is not None:
        driver = _DRIVERS[address] = subprocess.Popen(
            [sys.executable, "-m", "tests.replica_probe", "--address", address, "serve"],
            cwd=REPO,
            # the repository first, then what the caller's path has (the GPU host's vLLM and Ray live there)
            env=loopback_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    driver.stdin.write(json.dumps(args) + "\n")
    driver.stdin.flush()
    ready, _, _ = select.select([driver.stdout], [], [], timeout_s)
    line = driver.stdout.readline() if ready else ""
    if not line:
        stop_probes(address)
        if not ready:
            raise subprocess.TimeoutExpired(["replica_probe", *args], timeout_s)
        raise RuntimeError(f"replica_probe {' '.join(args)}: the driver exited")
    return json.loads(line)


def stop_probes(address: str | None = None) -> None:
    """End the driver of the cluster at `address` (every driver when None)."""
    for key in [address] if address is not None else list(_DRIVERS):
        driver = _DRIVERS.pop(key, None)
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()


atexit.register(stop_probes)


def _serve(parser: argparse.ArgumentParser) -> None:
    """Answer one request (a JSON list of this module's arguments) per line of stdin, one JSON line each on stdout
    ({"answer": ...} or {"error": ...}); what else prints goes to stderr."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        try:
            reply = {"answer": _run(parser.parse_args(json.loads(line)))}
        except BaseException as e:  # argparse exits; a failed call must not end the driver
            reply = {"error": "".join(traceback.format_exception_only(e)).strip()[-2000:]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def _run(ns: argparse.Namespace) -> Any:
    if ns.command == "call":
        return call_replica(ns.app, ns.deployment, ns.replica_id, ns.method, tuple(ns.args), json.loads(ns.kwargs))
    if ns.command == "each":
        return call_each_replica(
            ns.app, ns.deployment, ns.method, ns.replicas, args=tuple(ns.args), kwargs=json.loads(ns.kwargs)
        )
    return kill_replica(ns.app, ns.deployment, ns.replica_id)


def _parser(driver: bool) -> argparse.ArgumentParser:
    """The command line (`driver`: with --address and `serve`), or one request to a serving driver (without)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if driver:
        p.add_argument("--address", required=True, help="the cluster's GCS address")
    sub = p.add_subparsers(dest="command", required=True)
    each = sub.add_parser("each", help="call METHOD on each replica")
    each.add_argument("app")
    each.add_argument("deployment")
    each.add_argument("method")
    each.add_argument("--replicas", type=int, required=True)
    each.add_argument("--kwargs", default="{}", help="the method's keyword arguments (a JSON object)")
    each.add_argument("args", nargs="*", help="the method's arguments (strings; before the options)")
    call = sub.add_parser("call", help="call METHOD on one replica (by its id)")
    call.add_argument("app")
    call.add_argument("deployment")
    call.add_argument("replica_id")
    call.add_argument("method")
    call.add_argument("--kwargs", default="{}", help="the method's keyword arguments (a JSON object)")
    call.add_argument("args", nargs="*", help="the method's arguments (strings; before the options)")
    kill = sub.add_parser("kill", help="kill one replica actor")
    kill.add_argument("app")
    kill.add_argument("deployment")
    kill.add_argument("replica_id")
    if driver:
        sub.add_parser("serve", help="stay up: one request (these arguments, as a JSON list) per line of stdin")
    return p


def main(argv: list[str] | None = None) -> None:
    ns = _parser(driver=True).parse_args(argv)

    import ray

    ray.init(address=ns.address, logging_level="ERROR", log_to_driver=False)
    try:
        if ns.command == "serve":
            _serve(_parser(driver=False))
            return
        answer = _run(ns)
    finally:
        ray.shutdown()
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
