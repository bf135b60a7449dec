"""vLLM's AsyncLLM and its own OpenAI app, started in this process (the replica) inside the replica's
placement group."""

from __future__ import annotations

import inspect
import os
from argparse import Namespace
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from deployments.engine.args import openai_entrypoints
from deployments.engine.platform import CPU_SPIN_SLEEP_US, FORK_WORKERS_ENV, SPIN_SLEEP_ENV


@dataclass
class EngineApp:
    """A running AsyncLLM and vLLM's own OpenAI FastAPI app bound to it (in this process)."""

    engine: Any
    app: Any
    # where the engine core's other clients connect (one dict each, picklable), when it was started for several
    # front processes (`start_engine_app(..., clients=N)`): what `start_engine_client` takes in another process
    clients: list[dict] = field(default_factory=list)


async def start_engine_app(args: Namespace, metrics: bool = True, clients: int = 1) -> EngineApp:
    """vLLM's AsyncLLM and its OpenAI app; `metrics`: vLLM records its stats in this process (its default
    prometheus_client logger, which `engine_metric_samples` reads); False: none at all, as with `disable_log_stats`.
    `clients` > 1: the engine core takes that many clients, as under `vllm serve --api-server-count`: this process
    is client 0, `EngineApp.clients` says where clients 1.. connect (each in its own process, `start_engine_client`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs.from_cli_args(args)
    if clients > 1:
        engine_args._api_process_count, engine_args._api_process_rank = clients, -1  # the core's launcher
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    _use_replica_placement_group(vllm_config)
    _own_kv_side_channel(vllm_config)
    _nixl_reads_over_cuda_ipc(vllm_config)
    _offload_tier_events(vllm_config)
    _fork_workers_in_the_core(vllm_config)
    _cpu_spinners_sleep()
    log_stats = not (engine_args.disable_log_stats or not metrics)
    if clients == 1:
        engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=not log_stats,
        )
        addresses = []
    else:
        manager, addresses = _launch_shared_core(vllm_config, log_stats, clients)
        try:
            engine = _client(args, addresses[0], metrics)
        except BaseException:
            manager.close()
            raise
        # the core's processes are this client's to watch and stop, as if it had started them itself
        engine.engine_core.resources.engine_manager = manager
        engine.engine_core.start_engine_core_monitor()
    return EngineApp(engine=engine, app=await _openai_app(engine, args), clients=addresses[1:])


async def start_engine_client(args: Namespace, client: dict, metrics: bool = True) -> EngineApp:
    """Another client of an engine core that `start_engine_app(..., clients=N)` started (in another process of the
    same node): its own AsyncLLM (output processing, detokenization) and vLLM's OpenAI app on it."""
    engine = _client(args, client, metrics)
    return EngineApp(engine=engine, app=await _openai_app(engine, args))


def preload_client() -> None:
    """Import what `start_engine_client` runs (vLLM's engine client, its OpenAI app and `vllm serve`'s parser), so that
    a process started beside the engine has them by the time the engine takes clients."""
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

    from deployments.engine.args import _serve_parser

    _serve_parser()


def _client(args: Namespace, client: dict, metrics: bool):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs.from_cli_args(args)
    engine_args._api_process_count, engine_args._api_process_rank = client["client_count"], client["client_index"]
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats or not metrics,
        client_addresses={"input_address": client["input_address"], "output_address": client["output_address"]},
        client_count=client["client_count"],
        client_index=client["client_index"],
    )


def _launch_shared_core(vllm_config, log_stats: bool, clients: int) -> tuple[Any, list[dict]]:
    """Start the engine core (and its workers) for `clients` clients, each on its own pair of ZMQ addresses (IPC
    paths on this node), which each client binds; the core connects to them all. vLLM's own launcher, as
    `vllm serve --api-server-count` runs it: (the core processes' manager, each client's addresses)."""
    from vllm.v1.engine import utils
    from vllm.v1.executor import Executor

    if hasattr(utils, "get_engine_zmq_bind_addresses"):  # vLLM >= 0.27
        bound = utils.get_engine_zmq_bind_addresses(vllm_config, clients)
        addresses = utils.EngineZmqAddresses(inputs=list(bound.inputs), outputs=list(bound.outputs))
    else:  # vLLM 0.26
        addresses = utils.get_engine_zmq_addresses(vllm_config, clients)
    if not all(a.startswith("ipc://") for a in [*addresses.inputs, *addresses.outputs]):
        raise ValueError("front_processes > 1 needs the engine on the replica's node (one data-parallel rank)")
    launch_args = [vllm_config, Executor.get_class(vllm_config), log_stats, addresses]
    if "num_api_servers" in inspect.signature(utils.launch_core_engines).parameters:  # vLLM 0.26
        launch_args.append(clients)
    with utils.launch_core_engines(*launch_args) as launched:
        manager = launched.engine_manager if hasattr(launched, "engine_manager") else launched[0]
    return manager, [
        {"input_address": i, "output_address": o, "client_count": clients, "client_index": n}
        for n, (i, o) in enumerate(zip(addresses.inputs, addresses.outputs, strict=True))
    ]


async def _openai_app(engine, args: Namespace):
    """vLLM's OpenAI app on `engine` (shut down if the app cannot be built)."""
    _, build_app, init_app_state = openai_entrypoints()
    try:
        supported_tasks = await engine.get_supported_tasks()
        app = build_app(args, supported_tasks, engine.model_config)
        await init_app_state(engine, app.state, args, supported_tasks)
        # vLLM's engine-error handler sets `app.state.server.should_exit` (its uvicorn server's) so that `vllm serve`
        # exits once the engine is dead. No server runs here: Serve's health check replaces the replica instead.
        app.state.server = SimpleNamespace(should_exit=False)
    except BaseException:
        engine.shutdown()
        raise
    return app


def vllm_post_routes(args: Namespace, runner: str, convert: str, tasks: tuple[str, ...]) -> frozenset[str]:
    """Every POST path vLLM's `api_server` registers for a model of `args` run as `runner`/`convert` serving
    `tasks`: its app built as `vllm serve` builds it, without an engine (the route tables compared: routes.py)."""
    from vllm.config import ModelConfig

    _, build_app, _ = openai_entrypoints()
    app = build_app(args, tasks, ModelConfig(model=args.model, runner=runner, convert=convert))
    return frozenset(r.path for r in app.routes if "POST" in (getattr(r, "methods", None) or ()))


def _offload_tier_events(vllm_config) -> None:
    """With KV events on (kv_cache routing) and vLLM's native CPU offload (`kv_offloading_size`: its
    OffloadingConnector), have the connector publish its CPU tier's blocks as whole `BlockStored` events (tokens and
    parent, medium CPU), which the routers' index can name; without it they carry no tokens."""
    events = getattr(vllm_config, "kv_events_config", None)
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if events is None or not events.enable_kv_cache_events or kv is None:
        return
    if kv.kv_connector == "OffloadingConnector":
        kv.kv_connector_extra_config["self_describing_kv_events"] = True


def _own_kv_side_channel(vllm_config, env: dict | None = None) -> None:
    """NIXL's handshake listens on VLLM_NIXL_SIDE_CHANNEL_PORT (5600 by default) in every engine, on
    VLLM_NIXL_SIDE_CHANNEL_HOST (localhost): two engines of one node would collide, and a decode engine on
    another node could not reach it. Give each engine a free port and the node's Ray address, unless the
    environment sets them."""
    env = os.environ if env is None else env
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or not (kv.kv_connector or "").startswith("Nixl"):
        return
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
    if host is None:
        try:
            import ray

            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except Exception:  # noqa: BLE001 — outside Ray
            host = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env:
        import socket

        with socket.socket() as sock:
            sock.bind((host, 0))
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(sock.getsockname()[1])


def _nixl_reads_over_cuda_ipc(vllm_config, env: dict | None = None) -> None:
    """vLLM's NixlConnector reads the KV it loads (a remote GET); UCX serves a GET between GPUs of one node over
    cuda_ipc only where it detects NVLink, else it emulates it over TCP through host memory: a moved stream's 32k
    tokens of 8B KV took 9.1 s that way on one H200, 14-21 ms with the GET on cuda_ipc
    (bench/results/h200-kv-migration-cuda-ipc-2026-12-02.md). Turn it on for NIXL engines unless the environment
    sets it."""
    env = os.environ if env is None else env
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is not None and (kv.kv_connector or "").startswith("Nixl"):
        env.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")


def _fork_workers_in_the_core(vllm_config) -> None:
    """Ask the engine core to fork its `mp` workers (deployments/engine/platform.py: engine_core_forks_workers)
    instead of spawning them, unless the YAML's runtime_env sets SUMMIT_ENGINE_CORE_FORKS_WORKERS to 0."""
    if vllm_config.parallel_config.distributed_executor_backend == "mp" and os.environ.get(FORK_WORKERS_ENV) != "0":
        os.environ[FORK_WORKERS_ENV] = "1"


def _cpu_spinners_sleep() -> None:
    """On a CPU engine, vLLM's queue spinners sleep CPU_SPIN_SLEEP_US between polls instead of yielding
    (deployments/engine/platform.py: shm_spinners_sleep), unless the YAML's runtime_env sets SUMMIT_ENGINE_SPIN_SLEEP_US
    (0: vLLM's own `sched_yield`)."""
    from vllm.platforms import current_platform

    given = os.environ.get(SPIN_SLEEP_ENV)
    if given is not None:
        try:
            ok = float(given) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"runtime_env.env_vars.{SPIN_SLEEP_ENV}={given!r}: microseconds a CPU engine's queue spinners sleep "
                f'between polls; set a number such as "{CPU_SPIN_SLEEP_US}", or "0" for vLLM\'s own sched_yield'
            )
    elif current_platform.is_cpu():
        os.environ[SPIN_SLEEP_ENV] = str(CPU_SPIN_SLEEP_US)


def _use_replica_placement_group(vllm_config) -> None:
    """Hand the replica's placement group to vLLM's Ray executor.

    The engine core runs in a subprocess of the replica, where Ray reports no current placement group, so
    vLLM would otherwise ask for a second group of tp x pp GPUs, which the replica's group already holds
    (seen on the GPU host: "Engine core initialization failed").
    """
    if vllm_config.parallel_config.distributed_executor_backend != "ray":
        return
    import ray

    if not ray.is_initialized():
        return
    group = ray.util.get_current_placement_group()
    if group is not None:
        vllm_config.parallel_config.placement_group = group
    # The engine core subprocess calls `ray.init()` itself: point it at this replica's cluster, or it starts a
    # private local one where the group does not exist (vLLM then fails with KeyError 'bundles').
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
