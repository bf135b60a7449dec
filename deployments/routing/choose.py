"""Asking a deployment handle's router which replica would take a request, without sending it."""

from __future__ import annotations

import asyncio


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
