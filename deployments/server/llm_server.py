"""The engine deployment: each replica owns one vLLM AsyncLLM and runs vLLM's own OpenAI app on it, in-process.

On the direct path the deployment is the application's HTTP ingress (`serve.ingress()` with the app built here,
`__serve_build_asgi_app__`): HAProxy sends each request to the replica's own port. A deployment may then host
several models of one shape, one per replica (`models`, the replica's rank picks which); the replica reports its
model in `record_routing_stats` for the routers. On the two-hop path the OpenAIIngress calls `handle_http`.
Every request runs through the replica's front (server/front.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

from app.config import ModelConfig
from deployments import engine
from deployments.batch.share import OnlineBoard
from deployments.http.asgi import stream_asgi
from deployments.http.protocol import INTERNAL_SCOPE_KEY, HTTPRequest, ResponseStart
from deployments.observability import metrics
from deployments.observability.slo import LatencyWindow
from deployments.observability.tracing import Tracing
from deployments.server.batch_lines import BatchLines, LineAnswer
from deployments.server.config import ServerConfig
from deployments.server.front_host import FrontSite, build_front, start_adapter_sync
from deployments.server.front_process import FrontProcesses
from deployments.server.gpu_share import ShareGroupClient, group_name
from deployments.server.kv_events import start_kv_events
from deployments.server.pool import pool_model_index
from deployments.server.sleep import Sleeper
from deployments.server.startup import (
    LoadProgress,
    replica_full_id,
    replica_id,
    replica_rank,
    said_why,
    serve_log_file_kept,
    warm_up,
)

logger = logging.getLogger("ray.serve")
# How long a replica whose engine died stays up (healthy to Serve) while it relays resumed streams.
RELAY_GRACE_S = 300.0


class LLMServer:
    """One replica = one AsyncLLM + vLLM's OpenAI FastAPI app bound to it, in this process (no extra port); with
    `front_processes` > 1, further clients of its engine core serve the same port from front processes
    (server/front_process.py)."""

    async def __init__(self, config: ServerConfig):
        self._replica_id = replica_id()
        index = pool_model_index(replica_rank(), [m.deployment.num_replicas for m, _ in config.models])
        model, source = config.models[index]
        self.model, self._model, self._config = model.name, model, config
        self._dead_since: float | None = None
        self._sleeper: Sleeper | None = None  # the engine's sleep mode (models[].sleep)
        monitoring = config.monitoring
        metrics.enable(monitoring.metrics)
        self._metrics = metrics.ReplicaMetrics(model.name, self._replica_id)
        self._latency = LatencyWindow()
        self._kv_events = None  # routing.policy kv_cache: the actor indexing its engine's KV events (kv_events.py)
        kv_sockets = None
        if model.routing.policy == "kv_cache":
            self._kv_events, kv_sockets = await start_kv_events(replica_full_id())
        # the front processes start beside the engine (their imports meanwhile), and become its clients after it
        self._fronts = FrontProcesses.spawn(model.front_processes - 1) if model.front_processes > 1 else None
        try:
            self._engine_app = await self._start_sleeping_engine(model, source, kv_sockets)
        except BaseException:
            if self._fronts is not None:
                self._fronts.stop()
            raise
        if self._kv_events is not None:
            await self._kv_events.set_block_size.remote(engine.kv_block_size(self._engine_app.engine))
        self._tracing = Tracing(monitoring.tracing)
        clients = self._engine_app.clients  # the engine core's further clients: one per front process
        self._board = OnlineBoard.create(len(clients) + 1) if clients else None
        site = FrontSite(
            self._replica_id, self._metrics, self._tracing, model.front_processes, self._sleeper, board=self._board
        )
        self._front = build_front(config, model, self._engine_app, site)
        self._batch = BatchLines(
            self._engine_app,
            self._front,
            model.engine_kwargs.get("max_num_seqs") or engine.DEFAULT_MAX_NUM_SEQS,
            lambda name: name == self.model and self._front.options.disaggregated is None,
            self._front.options.batch_share,
        )
        self._adapter_sync = await start_adapter_sync(self._front)
        if self._fronts is not None:
            await self._fronts.attach(config, index, self._replica_id, clients, self._board.path)
            self._front.options.siblings = self._fronts.resumed  # its streams' resumes that reach this process
        self._metrics.start_counters()
        if monitoring.metrics:
            self._engine_metrics = metrics.EngineMetricsBridge(engine.engine_metric_samples, self._replica_id).start()

    async def _start_sleeping_engine(self, model: ModelConfig, source: str, kv_sockets: tuple[str, str] | None):
        """The engine, started in this replica's turn on its GPU where models share it; with sleep mode, put to sleep
        when idle or when another model waits for the GPU (server/sleep.py)."""
        if model.sleep is None:
            return await self._start_engine(model, source, kv_sockets)
        turns = None
        if model.share_group is not None:
            context = ray.get_runtime_context()
            app = serve.get_replica_context().app_name
            name = group_name(app, model.share_group[0], context.get_node_id(), ray.get_gpu_ids())
            turns = ShareGroupClient(name, self._replica_id)
            logger.info("%s shares its GPU by turns (group %s)", model.name, name)
        self._sleeper = Sleeper(_EngineSleep(self), model.sleep, turns, model.name)
        return await self._sleeper.start(lambda: self._start_engine(model, source, kv_sockets))

    async def _start_engine(self, model: ModelConfig, source: str, kv_sockets: tuple[str, str] | None = None):
        """vLLM's engine and OpenAI app for `model`, warmed up: the replica is ready once its engine answered.
        `kv_sockets`: where the engine publishes its KV events."""
        warmup = self._config.monitoring.warmup
        output = engine.OutputMark()  # where the engine's processes write: the root cause of a failure is there
        with serve_log_file_kept(), LoadProgress(self._metrics, model.name), said_why(model.name, output):
            engine.check_vllm_version(model.name)
            kwargs = engine.engine_args(model, kv_sockets)
            args = engine.serve_namespace(source, model.name, kwargs, model.frontend_kwargs)
            logger.info("Starting vLLM %s for %s from %s", engine.vllm_version(), model.name, source)
            self._metrics.load_stage("engine")
            engine_app = await engine.start_engine_app(
                args, metrics=self._config.monitoring.metrics, clients=model.front_processes
            )
            if warmup:
                self._metrics.load_stage("warmup")
                await warm_up(engine_app.app, model.name)
        self._metrics.load_stage("ready")
        logger.info("Replica of %s ready: its engine answered%s", model.name, " a warm-up request" if warmup else "")
        return engine_app

    async def __serve_build_asgi_app__(self):
        """The direct path's HTTP app (Serve calls this after __init__ when the deployment is the ingress). A bounded
        queue is the front's here (server/front_host.py), so that an overload is answered OpenAI-shaped (Serve's
        answer would be plain text). The replica's extra front processes join its port once Serve listens on it."""
        if self._fronts is not None:
            self._fronts.listen_when_serving()
        return self._front

    def record_routing_stats(self) -> dict:
        """What Summit's routers read per replica: the model it serves (a deployment may host several), its engine's
        KV-cache blocks, its LoRA adapters, which of them it has loaded, and the replica that loaded each adapter
        added at run time (deployments/lora/runtime.py)."""
        adapters = self._front.table.adapters
        stats: dict = {"model": self.model}
        engine_app = getattr(self, "_engine_app", None)
        blocks = engine.kv_cache_blocks(engine_app.engine) if engine_app is not None else None
        if blocks:  # kv_cache routing: what the engine's cache holds at most (deployments/routing/kv_policy.py)
            stats["kv_blocks"] = blocks
        if self._sleeper is not None:  # a sleeping replica is available but cold: routers prefer awake ones
            stats["asleep"] = not self._sleeper.awake
        if adapters is None:
            return stats
        stats = {**stats, "adapters": sorted(adapters.paths), "loaded": adapters.loaded()}
        runtime = self._front.options.runtime_lora
        if runtime is not None and runtime.homes:
            stats["homes"] = dict(runtime.homes)
        return stats

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaling policy reads per replica (custom metrics): the p90 time to first token and
        inter-token latency of this replica's engine since its last report, in ms (0: none observed), for
        `autoscaling_config.policy: {ttft_p90_ms, tpot_p90_ms}` (deployments/observability/slo.py)."""
        busy = engine.num_unfinished_requests(self._engine_app.engine) > 0
        return self._latency.report(engine.latency_buckets(), busy)

    async def handle_http(self, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Run one HTTP request through the front and vLLM's app; yields a ResponseStart, then body chunks. (A dead
        engine is the front's to answer: 503 + Retry-After, OpenAI-shaped, as on the direct path.)"""
        # A caller that goes away cancels this generator: stream_asgi tells vLLM's app (http.disconnect, then
        # cancellation), which aborts the engine request; the front logs it.
        # the front coalesces a stream's chunks; the bridge only merges what is already queued behind a slow caller
        async for item in stream_asgi(self._internal_front, request):
            yield item

    async def run_lines(
        self, route: HTTPRequest, lines: list[dict], busy_share: float | None = None
    ) -> AsyncIterator[LineAnswer]:
        """A group of batch lines ([{"url", "body", "request_id"}], one model's) run on this replica's engine; each
        line's answer as it finishes (server/batch_lines.py). `route`: what the routers read (the lines' model, the
        first line's body); `busy_share`: the fraction of the engine's sequences batch lines may hold while online
        requests run on this replica (None: the last one given). A sleeping engine wakes for them."""
        if self._sleeper is None:
            async for answer in self._batch.run(lines, busy_share):
                yield answer
            return
        async with self._sleeper.use():
            async for answer in self._batch.run(lines, busy_share):
                yield answer

    async def _internal_front(self, scope, receive, send) -> None:
        """The front for a request that came through a Serve handle: it was let in (API key) where it entered."""
        await self._front({**scope, INTERNAL_SCOPE_KEY: True}, receive, send)

    async def check_health(self) -> None:
        """Serve calls this periodically: a dead engine marks the replica unhealthy and Serve replaces it, but not while
        the front relays streams it resumed on other replicas (it holds their clients' connections; its own port
        answers new requests 503 meanwhile), for at most RELAY_GRACE_S after the engine died. Front processes learn
        of the death here (their streams then end or resume elsewhere, as the replica's own do) and count their
        relayed streams in; one that died fails the check."""
        if engine.engine_is_dead(self._engine_app.engine):
            relaying = self._front.relaying + (await self._fronts.engine_died() if self._fronts is not None else 0)
            if relaying:
                self._dead_since = self._dead_since or time.monotonic()
                if time.monotonic() - self._dead_since < RELAY_GRACE_S:
                    logger.info("engine dead; replica kept for %d resumed streams it relays", relaying)
                    return
        await engine.check_engine_health(self._engine_app.engine)
        if self._fronts is not None:
            await self._fronts.check()

    async def move_streams(self, *request_ids: str, recompute: bool = False) -> dict:
        """Move this replica's streams that can go on elsewhere (stream_migration) to other replicas of the model, now
        — to free its engine (before a redeploy, a sleep, or for another model's turn): each stream goes on from
        another replica, carrying its KV cache where `kv_migration` says so; given client request ids (`x-request-id`),
        only those. What each move did (`moved`): request id, tokens of context, `kv` (kv: carried, recompute:
        computed there again, ended: it ended first) and why. `recompute`: none carries its KV (a benchmark's
        control). A call for one replica goes to its actor (Serve's handles pick a replica themselves:
        tests/replica_probe.py `call`). Streams of the replica's extra front processes are not moved."""
        moved = await self._front.move_streams(set(request_ids) or None, recompute=recompute)
        return {"replica_id": self._replica_id, "moved": moved}

    async def stats(self) -> dict:
        """This replica's process and the requests its engine holds right now. Kept beside the metrics (which the
        tests read through Ray's metrics endpoint) for two reasons: the pid (tests stop or kill the engine's
        process), and live values (a metric is only as fresh as Ray's last report, seconds old, and Ray drops a gauge
        that stops changing: an idle engine's KV usage would be gone)."""
        return {
            "replica_id": self._replica_id,
            "model": self.model,
            "pid": os.getpid(),
            "num_unfinished_requests": engine.num_unfinished_requests(self._engine_app.engine),
            "kv_cache_usage": engine.kv_cache_usage(),
            "generation_tokens": engine.generation_tokens(),
            # what this process recorded (vLLM's counters and histograms; Summit's arrivals), as Ray's metrics
            # endpoint exports it once its reports are in: tests tell a count Summit missed from one Ray's export lost
            "recorded": {
                **engine.recorded_totals(),
                "summit:arrival_to_engine_seconds_count": self._metrics.arrivals,
                **{f"summit:pd_phase_seconds_count:{p}": n for p, n in self._metrics.pd_phases.items()},
            },
            # routing decisions this process's routers made (a disaggregated model's calls to its prefill pool)
            "routing_decisions": [
                {"model": m, "policy": p, "outcome": o, "count": n} for (m, p, o), n in metrics.decisions.items()
            ],
            # prompt tokens computed, found in the prefix cache, loaded through the KV connector (kv_migration)
            "prompt_tokens_by_source": engine.prompt_tokens_by_source(),
            # the KV connector's transfers (NIXL: time, bytes, descriptors), where it counts them
            "kv_connector": engine.kv_connector_counters(),
            # its extra front processes (models[].front_processes), each as its own process: pid, generated tokens
            "fronts": await self._fronts.stats() if self._fronts is not None else [],
            # routing.policy kv_cache: the blocks indexed from the engine's KV events
            "kv_events": await self._kv_events.stats.remote() if self._kv_events is not None else None,
            # sleep mode: Summit's view (asleep, wakes, sleeps, last wake's seconds) and the engine's own
            "sleep": self._sleeper.stats() if self._sleeper is not None else None,
            "engine_sleeping": await self._engine_sleeping() if self._sleeper is not None else None,
        }

    async def _engine_sleeping(self) -> bool | None:
        """vLLM's own `is_sleeping()`: a call into the engine core, so bounded (None: no answer within 5 s, as from a
        paused or dead engine)."""
        try:
            return await asyncio.wait_for(engine.engine_is_sleeping(self._engine_app.engine), 5)
        except Exception:  # noqa: BLE001 — stats stay live whatever the engine does
            return None

    async def adapters(self) -> dict:
        """This replica's LoRA adapters: `loaded`, what Summit holds loaded (and reports to the routers), beside the
        engine's own view (deployments/engine/lora.adapters_in_engine)."""
        adapters = self._front.table.adapters
        if adapters is None:  # a model without `lora:`: its engine runs no LoRA
            return {"replica_id": self._replica_id, "loaded": [], "registered": [], "in_engine": []}
        loaded = adapters.loaded()
        return {"replica_id": self._replica_id, "loaded": loaded, **await engine.adapters_in_engine(self._engine_app)}

    def recent_spans(self, trace_id: str | None = None) -> dict:
        """The spans this replica recorded (of one trace), with `monitoring.tracing.exporter: memory` (tests)."""
        return {"replica_id": self._replica_id, "model": self.model, "spans": self._tracing.recent_spans(trace_id)}

    def __del__(self):
        sleeper = getattr(self, "_sleeper", None)
        if sleeper is not None:
            sleeper.stop()
        # Without this each replica leaks its engine's shared-memory segments and sockets.
        fronts = getattr(self, "_fronts", None)
        if fronts is not None:  # their requests need the engine core, which goes with this process's client
            fronts.drain(self._model.deployment.graceful_shutdown_timeout_s)
        engine_app = getattr(self, "_engine_app", None)
        if engine_app is not None:
            engine.shutdown_engine(engine_app.engine)
            self._engine_app = None
        board = getattr(self, "_board", None)
        if board is not None:
            board.remove()
        kv_events = getattr(self, "_kv_events", None)
        if kv_events is not None:
            ray.kill(kv_events)
            self._kv_events = None


class _EngineSleep:
    """The replica's engine as its Sleeper puts it to sleep and wakes it."""

    def __init__(self, server: LLMServer):
        self._server = server

    async def sleep(self, level: int) -> None:
        await engine.sleep_engine(self._server._engine_app.engine, level)

    async def wake(self, level: int) -> None:
        await engine.wake_engine(self._server._engine_app.engine, level)
