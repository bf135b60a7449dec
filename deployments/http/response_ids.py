"""Stored responses' ids: each names the replica that keeps the response.

vLLM keeps a stored response (the Responses API with `VLLM_ENABLE_RESPONSES_API_STORE=1`: `GET /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`, `background`, `previous_response_id`) in the memory of the process that made it.
A replica's front gives each new response the id `resp_<32 hex>-<model tag>-<replica>` (vLLM's `request_id` field), so
that every Summit hop can send a request about that response to the replica that has it: the two-hop ingress and the
route picker pin it there (`TARGET_HEADER`, honoured by Summit's routers), and a front that got it anyway passes it on.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterable
from typing import NamedTuple

# POST: create a response (vLLM's request model: ResponsesRequest)
CREATE = "/v1/responses"
# GET /v1/responses/{id} (retrieve; ?stream=true&starting_after=N replays a background response's events),
# POST /v1/responses/{id}/cancel (a background response's)
ROUTE = re.compile(r"^/v1/responses/(?P<id>[^/]+?)(?P<cancel>/cancel)?$")
# The environment variable that makes vLLM keep responses (its default: off, as vLLM never evicts them)
STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
_ID = re.compile(r"^resp_[0-9a-f]{32}-(?P<tag>[0-9a-f]{8})-(?P<replica>[A-Za-z0-9_.-]{1,64})$")


class Owner(NamedTuple):
    """Who keeps a stored response: the model's tag and the replica's id (Serve's unique id)."""

    tag: str
    replica: str

    def model(self, names: Iterable[str]) -> str | None:
        """The model among `names` whose responses carry this tag."""
        return next((n for n in names if model_tag(n) == self.tag), None)


def model_tag(model: str) -> str:
    return hashlib.blake2s(model.encode(), digest_size=4).hexdigest()


def new_id(model: str, replica: str) -> str:
    return f"resp_{uuid.uuid4().hex}-{model_tag(model)}-{replica}"


def owner_of(response_id: object) -> Owner | None:
    """The replica keeping `response_id`, where Summit made it (None: not an id of Summit's: the client set
    `request_id` itself, or it is no id at all)."""
    found = _ID.match(response_id) if isinstance(response_id, str) else None
    return Owner(found["tag"], found["replica"]) if found else None


def store_on(value: object) -> bool:
    """Whether `STORE_ENV`'s value turns vLLM's store on (vLLM reads it as an integer)."""
    try:
        return bool(int(str(value)))
    except ValueError:
        return False
