"""The direct path's ingress request router: HAProxy asks it which engine replica takes each POST.

Serve's HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1) calls `POST /internal/route` here with the client's body (when
RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1), `x-request-id` and the session header, then sends the request
itself straight to the replica named in the answer: `{"replica_id": "SERVE_REPLICA::<app>#<deployment>#<id>"}`.
The choice is the engine deployment's own request router (deployments/routing/routers.py: least_load, prefix_affinity,
session_affinity), asked through a handle without sending anything (`choose_replica(_reserve=False)`), with the
body's model so that a deployment hosting several models keeps each request to its model's replicas.

HAProxy turns any answer but 200 into its own plain-text 503, so every request gets a replica here: one whose
model is unknown or unavailable goes to any replica, whose front answers the OpenAI-shaped 4xx/503 itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.http.protocol import TARGET_HEADER, HTTPRequest
from deployments.http.response_ids import owner_of
from deployments.observability import metrics
from deployments.observability.tracing import DECISION_HEADER, decision_value
from deployments.routing.choose import chosen_replica

logger = logging.getLogger("ray.serve")

# How long a routing decision may wait for the model's replicas (HAProxy gives the router 5 s in all).
PICK_TIMEOUT_S = 3.0
# Request headers the routers read (session affinity), as HAProxy forwards them.
_ROUTING_HEADERS = {"x-session-id", "x-request-id"}

picker_api = FastAPI(docs_url=None, redoc_url=None)


def body_fields(body: bytes) -> tuple[str | None, str | None]:
    """The `model` a JSON body names and the replica keeping the response it continues (`previous_response_id`, a
    Summit id), each if any (the body may be cut at HAProxy's buffer size: then neither)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # cut, or nested too deeply: the replica's front answers it
        return None, None
    if not isinstance(payload, dict):
        return None, None
    name, owner = payload.get("model"), owner_of(payload.get("previous_response_id"))
    return (name if isinstance(name, str) else None), (owner.replica if owner else None)


@serve.ingress(picker_api)
class RoutePicker:
    def __init__(self, engines: DeploymentHandle):
        self._engines = engines

    @picker_api.post("/internal/route")
    async def route(self, request: Request) -> Response:
        body = await request.body()
        headers = [(k.encode(), v.encode()) for k, v in request.headers.items() if k in _ROUTING_HEADERS]
        model, keeper = body_fields(body)
        wanted = HTTPRequest("POST", "", body, b"", headers, model=model)
        if keeper is not None:  # a response continued: to the replica keeping the previous one
            wanted.set_header(TARGET_HEADER, keeper.encode())
        session = request.headers.get("x-session-id")
        handle = self._engines.options(session_id=session) if session else self._engines
        try:
            replica_id = await asyncio.wait_for(chosen_replica(handle, wanted), PICK_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 — no replica of that model now: any replica answers the client
            logger.warning(
                "no replica of model %r within %.0f s (%s); any replica answers",
                wanted.model,
                PICK_TIMEOUT_S,
                type(e).__name__,
            )
            started = time.time()
            replica_id = await asyncio.wait_for(chosen_replica(self._engines, HTTPRequest("POST", "")), PICK_TIMEOUT_S)
            metrics.routing_decision(wanted.model, "any", "fallback")
            wanted.set_header(DECISION_HEADER, decision_value("any", "fallback", "", started, time.time()).encode())
        # HAProxy sets these on the request it sends to the replica (x-serve-router-*: a client's are dropped)
        decision = wanted.header(DECISION_HEADER)
        return JSONResponse(
            {
                "replica_id": replica_id,
                "request_headers": {DECISION_HEADER.decode(): decision.decode()} if decision else {},
            }
        )

    @picker_api.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)
