"""A replica's extra front processes (`models[].front_processes` > 1): one engine's serving work past one Python
process, as `vllm serve --api-server-count` does.

The replica starts its engine core for N clients (deployments/engine: `start_engine_app(..., clients=N)`) and is
client 0. Each further client is a FrontProcess: a Ray actor on the replica's node with its own AsyncLLM client of
that engine core (it turns the core's outputs into text and OpenAI chunks), vLLM's OpenAI app on it and the same
ReplicaFront the replica runs (server/front_host.py). It listens on the replica's own HTTP port: the replica sets
SO_REUSEPORT on the socket Serve bound, each front process binds the port with it too, and the kernel spreads
HAProxy's connections over the processes. So HAProxy, Serve's controller and the routers still see one replica.

What the replica keeps to itself: Serve's calls (`handle_http` on the two-hop path, batch lines, stats), its
own requests' count in Serve's metrics (autoscaling and the routers' load read that count: about 1/N of the load
where N processes share the port), and the engine core's processes (it stops them; a front process that dies makes
the replica unhealthy, so Serve replaces the whole replica).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deployments import engine
from deployments.batch.share import OnlineBoard
from deployments.http.asgi import stream_asgi
from deployments.http.errors import OpenAIError
from deployments.http.protocol import INTERNAL_SCOPE_KEY, OWNER_HEADER, HTTPRequest
from deployments.http.stream_ids import LAST_EVENT_HEADER, StreamPoint
from deployments.observability import metrics
from deployments.observability.tracing import Tracing
from deployments.server.config import ServerConfig
from deployments.server.front_host import FrontSite, build_front, start_adapter_sync
from deployments.server.startup import serve_log_file_kept

logger = logging.getLogger("ray.serve")
# How long the replica waits for Serve's HTTP server to listen (then for its front processes to listen too), and for
# its front processes to start (each its engine client and vLLM's app: imports, tokenizer, on a loaded node).
LISTEN_WAIT_S = 120.0
READY_WAIT_S = 1800.0
# the response header that names the front process (1 .. N-1) that answered; the replica's own answers carry none
FRONT_HEADER = b"x-summit-front"


def serve_listener():
    """The socket Serve's direct-path HTTP server of this replica process listens on, once it does (psutil's
    connection: fd, address), found by Serve's port range for replicas."""
    from ray.serve._private import constants

    low, high = constants.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, constants.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT
    process = psutil.Process()
    connections = getattr(process, "net_connections", None) or process.connections  # psutil < 6: connections()
    for conn in connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and low <= conn.laddr.port <= high and conn.fd >= 0:
            return conn
    return None


def reuse_port(fd: int) -> None:
    """Let other processes bind the port of Serve's listening socket (SO_REUSEPORT on the socket it bound, without
    rebinding it): the kernel then spreads new connections over every socket bound there."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    finally:
        sock.close()  # the duplicate only


async def serve_http_options():
    """Serve's HTTP options (http_options of the YAML: keep-alive, root path, middlewares) as its controller gives
    them to each replica's server."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return await controller.get_http_config.remote()


class FrontProcesses:
    """The replica's side: starts its front processes as its engine starts (`spawn`), makes each a client of it
    before the replica is ready (`attach`), has them listen on its port once Serve does, checks they live, drains
    them."""

    def __init__(self, actors: list):
        self.actors = actors
        self._listening: asyncio.Task | None = None
        self.failure: str | None = None

    @classmethod
    def spawn(cls, count: int) -> FrontProcesses:
        """`count` front processes on the replica's node, started before its engine so that their start (a Ray worker,
        torch's and vLLM's imports: ~30 s on a GPU node) runs while the engine loads; `attach` makes them fronts."""
        actor = ray.remote(FrontProcess).options(
            num_cpus=0,  # each runs on a core of the replica's node beside the replica (docs: front processes)
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        )
        return cls([actor.remote() for _ in range(count)])

    async def attach(self, config: ServerConfig, model_index: int, replica_id: str, clients: list[dict], board: str):
        """Each front process a client of the replica's engine core (`clients`, one each) with its front; returns
        once each has them. `board`: the replica's OnlineBoard's file. Stops them all if one fails."""
        context = ray.serve.get_replica_context()
        deployment = (context.deployment, context.app_name)
        fronts = len(clients) + 1
        try:
            await asyncio.wait_for(
                asyncio.gather(
                    *(
                        a.attach.remote(config, model_index, client, deployment, replica_id, fronts, board)
                        for a, client in zip(self.actors, clients, strict=True)
                    )
                ),
                READY_WAIT_S,
            )
        except BaseException:
            self.stop()
            raise

    def listen_when_serving(self) -> None:
        """Once Serve's HTTP server of this replica listens, the front processes listen on its port too."""
        self._listening = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        try:
            deadline, listener = time.monotonic() + LISTEN_WAIT_S, None
            while listener is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Serve's HTTP server of this replica did not listen within {LISTEN_WAIT_S:g} s")
                await asyncio.sleep(0.05)
                listener = serve_listener()
            reuse_port(listener.fd)
            (host, port), http_options = listener.laddr, await serve_http_options()
            await asyncio.wait_for(
                asyncio.gather(*(a.serve.remote(host, port, http_options) for a in self.actors)), LISTEN_WAIT_S
            )
            logger.info("%d front processes of this replica listen on port %d beside it", len(self.actors), port)
        except Exception as e:  # noqa: BLE001 — the replica turns unhealthy, and Serve replaces it
            self.failure = f"{type(e).__name__}: {e}"
            logger.error("front processes of this replica failed to listen: %s", self.failure)

    def stop(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []

    async def check(self) -> None:
        """Raises when a front process failed to start or died (Serve then replaces the replica)."""
        if self.failure is not None:
            raise RuntimeError(f"a front process of this replica failed: {self.failure}")
        if self.actors:
            try:
                await asyncio.wait_for(asyncio.gather(*(a.alive.remote() for a in self.actors)), 30)
            except Exception as e:  # noqa: BLE001
                self.failure = f"{type(e).__name__}: {e}"
                raise RuntimeError(f"a front process of this replica died: {self.failure}") from e

    async def engine_died(self) -> int:
        """Tell the front processes their engine core is gone; the streams they relay (resumed elsewhere)."""
        counts = await asyncio.gather(*(a.engine_died.remote() for a in self.actors), return_exceptions=True)
        return sum(c for c in counts if isinstance(c, int))

    def resumed(self, front: int, point: StreamPoint, caller: bytes) -> ActorStream:
        """A resume of a stream that front process `front` keeps, as that process answers it (relay() reads it)."""
        if not 1 <= front <= len(self.actors):
            raise OpenAIError(410, f"stream {point.stream!r} can no longer be resumed: its front process is gone")
        actor = self.actors[front - 1]
        return ActorStream(actor.resumed.options(num_returns="streaming").remote(point, caller))

    async def stats(self) -> list[dict]:
        if not self.actors or self.failure:
            return []
        return list(await asyncio.gather(*(a.stats.remote() for a in self.actors)))

    def drain(self, timeout_s: float) -> None:
        """Stop the front processes taking connections and wait (at most `timeout_s`) for their requests to end;
        the replica's own requests have drained by then (Serve waits for them before the replica's __del__)."""
        if not self.actors:
            return
        try:
            ray.get([a.drain.remote(timeout_s) for a in self.actors], timeout=timeout_s + 5)
        except Exception as e:  # noqa: BLE001 — stopping anyway
            logger.warning("front processes did not drain: %s: %s", type(e).__name__, e)
        self.stop()


class ActorStream:
    """A front process's answer (a Ray streaming generator: a ResponseStart, then body chunks) read as a Serve response
    stream is (http/relay.py)."""

    def __init__(self, refs):
        self._refs = refs

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await (await self._refs.__anext__())

    def cancel(self) -> None:
        try:
            ray.cancel(self._refs)
        except Exception:  # noqa: BLE001 — ended already
            pass


class FrontProcess:
    """One extra front process of a replica (a Ray actor on its node): a client of the replica's engine core,
    vLLM's OpenAI app and the replica's front, served on the replica's port."""

    def __init__(self):
        """Started beside the replica's engine: what its engine client will need is imported meanwhile."""
        self._engine_app = None
        self._server = None
        self._draining = False
        self._running = 0
        with serve_log_file_kept():  # vLLM's imports configure logging
            engine.preload_client()

    async def attach(
        self,
        config: ServerConfig,
        model_index: int,
        client: dict,
        deployment: tuple[str, str],
        replica_id: str,
        fronts: int,
        board: str,
    ) -> None:
        """A client of the replica's engine core (`client`: where it connects), vLLM's OpenAI app on it and the
        replica's front; `fronts`: the replica's processes in all, `board` its OnlineBoard's file."""
        model, source = config.models[model_index]
        # its own series in the metrics (`replica` label); its answers name the replica (x-summit-replica), whose
        # engine they ran on (a resumed stream avoids that replica)
        front_id = f"{replica_id}-front{client['client_index']}"
        self._index = str(client["client_index"]).encode()
        self._front_id, self._route_prefix, self._app_name = front_id, "/", deployment[1]
        monitoring = config.monitoring
        metrics.enable(monitoring.metrics)
        self._metrics = metrics.ReplicaMetrics(model.name, front_id)
        with serve_log_file_kept():
            args = engine.serve_namespace(source, model.name, engine.engine_args(model), model.frontend_kwargs)
            self._engine_app = await engine.start_engine_client(args, client, metrics=monitoring.metrics)
        self._tracing = Tracing(monitoring.tracing)
        # its online requests on the replica's board: the replica's batch lines make room for them too
        online, slot = OnlineBoard(board, fronts), client["client_index"]
        site = FrontSite(replica_id, self._metrics, self._tracing, fronts, None, deployment, online, slot)
        self._front = build_front(config, model, self._engine_app, site)
        self._adapter_sync = await start_adapter_sync(self._front)
        self._metrics.start_counters()
        if monitoring.metrics:
            self._engine_metrics = metrics.EngineMetricsBridge(engine.engine_metric_samples, front_id).start()

    async def serve(self, host: str, port: int, http_options) -> int:
        """Listen on the replica's port (SO_REUSEPORT) as Serve serves the replica: uvicorn with Serve's HTTP options
        and middlewares (its request id first) around the front; returns the pid."""
        import uvicorn
        from ray.serve._private.http_util import (
            _apply_middlewares,
            configure_http_middlewares,
            configure_http_options_with_defaults,
        )

        options = configure_http_middlewares(configure_http_options_with_defaults(http_options))
        app = _apply_middlewares(self._asgi, options.middlewares)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        self._server = uvicorn.Server(
            uvicorn.Config(
                lambda: app,  # a factory, as Serve gives its app (uvicorn calls an app once to tell)
                factory=True,
                host=host,
                port=port,
                root_path=options.root_path,
                timeout_keep_alive=options.keep_alive_timeout_s,
                lifespan="off",
                access_log=False,
                log_level=None,
                log_config=None,
            )
        )
        self._server.install_signal_handlers = lambda: None  # not the actor's main thread (as Serve does)
        self._serving = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises why it stopped
            await asyncio.sleep(0.05)
        logger.info("front process %s (pid %d) listens on %s:%d", self._front_id, os.getpid(), host, port)
        return os.getpid()

    async def _asgi(self, scope, receive, send) -> None:
        """Serve's own routes on a replica's port (HAProxy's health check, /-/routes) as the replica answers them,
        then the front. Every answer names this front process (`x-summit-front: <i>`; the replica's own answers
        carry none)."""
        if scope["type"] != "http":
            await self._front(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (FRONT_HEADER, self._index)]}
            await send(message)

        if scope["path"] in ("/-/healthz", "/-/routes"):
            await self._serve_route(scope["path"], send_named)
            return
        self._running += 1
        try:
            await self._front(scope, receive, send_named)
        finally:
            self._running -= 1

    async def _serve_route(self, path: str, send) -> None:
        healthy = not self._draining and not engine.engine_is_dead(self._engine_app.engine)
        if healthy and path == "/-/routes":
            body, kind = json.dumps({self._route_prefix: self._app_name}).encode(), b"application/json"
        else:
            body, kind = (b"success" if healthy else b"DRAINING" if self._draining else b"UNHEALTHY"), b"text/plain"
        headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200 if healthy else 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def resumed(self, point: StreamPoint, caller: bytes):
        """A resume of a stream this process keeps, asked by its replica (a client's resume reached that process):
        the answer as LLMServer.handle_http gives one."""
        headers = [(LAST_EVENT_HEADER, f"{point.stream}:{point.seen}".encode()), (OWNER_HEADER, caller)]

        async def internal(scope, receive, send) -> None:
            await self._front({**scope, INTERNAL_SCOPE_KEY: True}, receive, send)

        async for item in stream_asgi(internal, HTTPRequest("POST", "/v1/completions", b"", headers=headers)):
            yield item

    def alive(self) -> bool:
        if engine.engine_is_dead(self._engine_app.engine):
            raise RuntimeError(f"front process {self._front_id}: its engine client is dead")
        return True

    def engine_died(self) -> int:
        """The replica's engine core is gone (its own client saw it): this client fails its requests as vLLM does
        when it sees the death itself, so their streams end, or resume on another replica (stream migration).
        Returns the streams this front relays."""
        engine.mark_engine_dead(self._engine_app.engine)
        return self._front.relaying

    def stats(self) -> dict:
        """As LLMServer.stats reports its own process."""
        return {
            "front_id": self._front_id,
            "pid": os.getpid(),
            "listening": self._server is not None and self._server.started,
            "running": self._running,
            "generation_tokens": engine.generation_tokens(),
        }

    async def drain(self, timeout_s: float) -> None:
        self._draining = True
        if self._server is not None:
            for server in self._server.servers:
                server.close()  # no new connections; the open ones go on
        deadline = time.monotonic() + timeout_s
        while self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    def __del__(self):
        engine_app = getattr(self, "_engine_app", None)
        if engine_app is not None:
            engine.shutdown_engine(engine_app.engine)
            self._engine_app = None
