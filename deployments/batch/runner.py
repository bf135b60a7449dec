"""The BatchRunner deployment: works through the store's batches, one at a time, oldest first, on the application's
own engine deployments (the same handles online traffic takes), behind online traffic: on a model whose engine runs
vLLM's priority scheduling a batch line carries a lower priority than any online request; elsewhere batch work is
bounded to `batch.max_concurrency` lines in flight.

Everything it knows lives in the store: a runner that is killed and replaced, or an application that is shut down and
deployed again, finds the batch in progress there, skips the lines that have a result, and runs the rest (a line that
was in flight runs again; the store keeps one result per line).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

from ray import serve

from app.config.batch import BatchOptions
from deployments.batch.core import Answer, Unavailable, run_lines
from deployments.batch.lines import Line, parse_lines, unrun_line
from deployments.http.errors import OpenAIError
from deployments.http.protocol import HTTPRequest
from deployments.http.relay import replica_failures
from deployments.observability import metrics

logger = logging.getLogger("ray.serve")

# how often an idle runner looks at the store unasked
IDLE_POLL_S = 30.0
# finished lines are recorded in groups: at most this many, or after this long
_RECORD_EVERY = 64
_RECORD_AFTER_S = 0.25


class BatchRunner:
    def __init__(self, options: dict, engines: dict[str, str], priority_models: list[str], store: str):
        """`engines`: each model's engine deployment name (in this application); `priority_models`: the models whose
        engines schedule by priority; `store`: the BatchAPI deployment's name."""
        self._store_name = store
        self.options = BatchOptions.model_validate(options)
        self._engines = engines
        self._priority = set(priority_models)
        self._handles: dict[str, object] = {}
        self._wake = asyncio.Event()
        for model in engines:  # the progress counters at 0 before the first line
            for outcome in ("completed", "failed"):
                metrics.batch_line(model, outcome, 0)
        self._task = asyncio.get_running_loop().create_task(self._run())
        self.current: str | None = None

    # async: on the event loop (a sync method would run in Serve's thread pool, and Event is not thread-safe)
    async def wake(self) -> None:
        self._wake.set()

    def state(self) -> dict:
        """For tests and operators: this replica's process and the batch it works on."""
        replica = serve.get_replica_context().replica_id.unique_id
        return {"replica_id": replica, "pid": os.getpid(), "batch": self.current, "running": not self._task.done()}

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _handle(self, deployment: str):
        if deployment not in self._handles:
            app = serve.get_replica_context().app_name
            self._handles[deployment] = serve.get_deployment_handle(deployment, app)
        return self._handles[deployment]

    async def _run(self) -> None:
        last_expiry = 0.0
        while True:
            self._wake.clear()  # before the look: a batch created during this pass wakes the next one at once
            try:
                store = self._handle(self._store_name)
                active = await store.active_batches.remote()
                metrics.batches_active(len(active))
                for batch in active:
                    self.current = batch["id"]
                    await self._work(store, batch)
                self.current = None
                if time.monotonic() - last_expiry > 3600:
                    last_expiry = time.monotonic()
                    await store.expire_files.remote()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 — the store restarting, a bug in one batch: log, look again later
                logger.exception("batch runner: a pass over the batches failed; trying again")
                await asyncio.sleep(self.options.poll_s)
            # idle: the store wakes this on every create and cancel; the slow look is for a wake that was missed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(self.options.poll_s, IDLE_POLL_S))

    async def _work(self, store, batch: dict) -> None:
        batch_id = batch["id"]
        data = await store.file_bytes.remote(batch["input_file_id"])
        lines, errors = parse_lines(data, batch["endpoint"], list(self._engines), self.options.max_lines)
        if batch["status"] == "validating":
            if errors:
                logger.info("batch %s failed validation: %d errors", batch_id, len(errors))
                listed = {"object": "list", "data": [e.as_openai() for e in errors[:1000]]}
                await store.update_batch.remote(batch_id, ("validating",), status="failed", errors=listed)
                return
            batch = await store.update_batch.remote(
                batch_id,
                ("validating",),
                status="in_progress",
                request_counts={"total": len(lines), "completed": 0, "failed": 0},
            )
        elif errors:  # cancelled before it was validated
            await store.finalize.remote(batch_id, "cancelled", [])
            return
        if batch["status"] == "finalizing":  # all lines were done when the last runner stopped
            await store.finalize.remote(batch_id, "completed", [])
            return
        finished = await store.finished_ids.remote(batch_id)
        remaining = [line for line in lines if line.custom_id not in finished]
        logger.info("batch %s: %d of %d lines to run", batch_id, len(remaining), len(lines))
        why = await self._run_lines(store, batch, remaining)
        finished = await store.finished_ids.remote(batch_id)
        unfinished = [line for line in lines if line.custom_id not in finished]
        if why is None and not unfinished:
            await store.update_batch.remote(batch_id, ("in_progress",), status="finalizing")
            await store.finalize.remote(batch_id, "completed", [])
        elif why is not None:
            code, status = why
            message = {
                "batch_expired": "the batch's completion_window ended before this request ran",
                "batch_cancelled": "the batch was cancelled before this request ran",
            }[code]
            await store.finalize.remote(
                batch_id,
                status,
                [(line.custom_id, line.number, unrun_line(line, code, message)) for line in unfinished],
            )
        logger.info("batch %s: %s", batch_id, "done" if why is None else why[1])

    async def _run_lines(self, store, batch: dict, lines: list[Line]) -> tuple[str, str] | None:
        """Run the lines, recording results as they finish; None when all ran, else (error code, final status) of
        what stopped it (cancelled, expired)."""
        batch_id = batch["id"]
        stop: list[tuple[str, str]] = []
        if batch["status"] == "cancelling":
            return "batch_cancelled", "cancelled"
        pending: list[tuple[str, int, bool, dict]] = []
        flushed = asyncio.Event()

        async def flush() -> None:
            while pending:
                group, pending[:] = list(pending), []
                await store.record.remote(batch_id, group)

        async def done(line: Line, ok: bool, result: dict, tokens: int) -> None:
            pending.append((line.custom_id, line.number, ok, result))
            metrics.batch_line(line.model, "completed" if ok else "failed")
            if len(pending) >= _RECORD_EVERY:
                await flush()

        async def watch() -> None:
            while not flushed.is_set():
                await asyncio.sleep(_RECORD_AFTER_S)
                await flush()
                current = await store.get_batch.remote(batch_id)
                if current["status"] == "cancelling" and not stop:
                    stop.append(("batch_cancelled", "cancelled"))
                elif time.time() >= current["expires_at"] and not stop:
                    stop.append(("batch_expired", "expired"))

        watcher = asyncio.create_task(watch())
        try:
            await run_lines(
                lines, self._send_group, done, self.options.max_concurrency, self.options.group_size, lambda: bool(stop)
            )
        finally:
            flushed.set()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await flush()
        return stop[0] if stop else None

    def _send_group(self, lines: list[Line]):
        model = lines[0].model
        priority = self.options.priority if model in self._priority else None
        return send_group(self._handle(self._engines[model]), lines, priority, self.options.online_share)


async def send_group(
    handle, lines: list[Line], priority: int | None = None, busy_share: float | None = None
) -> AsyncIterator[tuple[Line, Answer]]:
    """A group of one model's batch lines through one of its engine replicas (`run_lines`: vLLM's serving objects
    in the replica's process, server/batch_lines.py); each line's answer as it finishes. Unavailable when the replica
    could not take or finish the group (the lines not answered are retried)."""
    payload = []
    for line in lines:
        body = dict(line.body)
        if priority is not None:
            body.setdefault("priority", priority)
        payload.append({"url": line.url, "body": body, "request_id": f"batch-{uuid.uuid4().hex}"})
    first = lines[0]
    route = HTTPRequest("POST", first.url, json.dumps(first.body).encode(), b"", [], model=first.model)
    try:
        with replica_failures():
            async for answer in handle.options(stream=True).run_lines.remote(route, payload, busy_share):
                yield lines[answer.index], Answer(answer.status, answer.body, payload[answer.index]["request_id"])
    except OpenAIError as e:  # no replica could take it (dead, restarting, overloaded): the core retries the rest
        raise Unavailable(str(e)) from None
