"""Passing an HTTP request on through a Serve handle — to another model's replica, or to the Batch API's store — and
its answer back to the client (the front on the direct path; the two-hop ingress for the Batch API)."""

from __future__ import annotations

import asyncio
import hashlib
import logging

from deployments.errors import error_response
from deployments.replica_stream import ModelUnavailable, first_response, replica_failures

logger = logging.getLogger("ray.serve")

# The Batch API's routes (/v1/files..., /v1/batches...): served by the BatchAPI deployment (deployments/batch_api.py).
BATCH_PREFIXES = ("/v1/files", "/v1/batches")
# Who owns a file or batch (a hash of the caller's API key), as the HTTP entry tells the BatchAPI; a client's own is
# dropped.
OWNER_HEADER = b"x-summit-owner"


async def relay(stream, name: str, scope, receive, send) -> None:
    """Pass a Serve response stream (another replica's or the BatchAPI's handle_http) on to the client; a client that
    leaves cancels it."""

    async def cancel_on_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        stream.cancel()  # the client left: abort the request there

    watcher = asyncio.create_task(cancel_on_disconnect())
    try:
        try:
            start = await first_response(stream)
        except ModelUnavailable as e:
            await error_response(e.status, str(e), headers={"retry-after": e.retry_after})(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": start.status, "headers": start.headers})
        try:
            with replica_failures():
                async for chunk in stream:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except ModelUnavailable as e:
            logger.warning("forwarded request to %s ended early: %s", name, e)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watcher.cancel()
        stream.cancel()  # a no-op after the end


def owner_of(authorization: bytes | None) -> bytes:
    """The owner of the files and batches a caller makes: a hash of its API key (never the key itself)."""
    token = (authorization or b"").removeprefix(b"Bearer ").strip()
    return hashlib.sha256(token).hexdigest()[:24].encode()


async def chosen_replica(handle, request) -> str:
    """The full id of the replica the handle's router would choose for `request`, without sending anything (Serve's
    `choose_replica(_reserve=False)`); waits while the router has no replica for it."""
    async with handle.choose_replica(request, _reserve=False) as selection:
        return selection._replica.replica_id.to_full_id_str()


async def can_route(handle, request, timeout_s: float = 3.0) -> bool:
    """Whether the handle's router has a running replica for `request` (its model) within `timeout_s`."""
    try:
        await asyncio.wait_for(chosen_replica(handle, request), timeout_s)
    except Exception:  # noqa: BLE001 — no replica of that model now (timeout), or the deployment is gone
        return False
    return True
