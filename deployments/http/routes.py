"""The one route table both HTTP entries dispatch by (the replica's front on the direct path, the two-hop ingress):
which of an entry's handlers a request goes to, and whether it is answered before the API-key check.

The model routes (POST_ROUTES) are those vLLM's own server registers for a model's task that a client calls:
generation (completions, chat, responses, Anthropic's messages) and pooling (embeddings, pooling, scoring, reranking,
classification), plus the tokenizer's. Which of them a model serves is vLLM's app's own route table for its task
(the front answers a route of another task 404, naming those it serves); vLLM's app has more (metrics, admin,
render, elastic scaling) that stay unreachable. tests/cpu/test_routes.py compares this table with the routes vLLM's
`api_server` registers for each task."""

from __future__ import annotations

import re
from dataclasses import dataclass

from deployments.http import response_ids
from deployments.http.protocol import BATCH_PREFIXES

POST_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",  # Anthropic's Messages API (vLLM >= 0.27 serves it for generative models)
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)
# The POST routes vLLM's `api_server` registers for a task that Summit leaves out, and why (tests/cpu/test_routes.py
# fails on a route of vLLM's that is in neither table, so a new one is a decision, not an omission).
VLLM_ROUTES_LEFT_OUT = {
    "/ping": "SageMaker's health check (Summit's: GET /health)",
    "/invocations": "SageMaker's one entry for every task",
    "/inference/v1/generate": "token ids in and out, no OpenAI shape",
    "/inference/v1/abort_requests": "an admin route",
    "/scale_elastic_ep": "an admin route (elastic expert parallelism)",
    "/is_scaling_elastic_ep": "an admin route (elastic expert parallelism)",
    "/v1/chat/completions/render": "prompt rendering without generation",
    "/v1/chat/completions/derender": "prompt rendering without generation",
    "/v1/completions/render": "prompt rendering without generation",
    "/v1/completions/derender": "prompt rendering without generation",
    "/v1/responses/render": "prompt rendering without generation",
    "/v1/messages/render": "prompt rendering without generation",
    "/v1/chat/completions/batch": "several chats in one request (Summit's batches: the Batch API)",
    "/generative_scoring": "vLLM's own scoring API for generative models, not OpenAI's",
    "/v1/systemone": "vLLM's structured decisions API, not OpenAI's",
    "/v2/embed": "Cohere's embed API (OpenAI's: /v1/embeddings)",
    "/v1/responses/{response_id}/cancel": "served, as the stored-response route (GET/POST /v1/responses/{id}...)",
}
# vLLM's runtime LoRA routes (models[].lora.runtime_loading)
LORA_LOAD, LORA_UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@dataclass(frozen=True)
class Route:
    """Where a request goes: `handler`, the name of an entry's handler (each entry has one for every name route_of
    gives); `public`: answered without an API key (the health check, the OpenAPI document, as vLLM's own server);
    `match`: the path's parts, if any."""

    handler: str
    public: bool = False
    match: re.Match | None = None


def route_of(method: str, path: str) -> Route | None:
    """The route of a request, in the order the entries check them; None: not served (the entry's 404/405)."""
    if path == "/health":
        return Route("health", public=True)
    if method == "GET" and path == "/openapi.json":
        return Route("openapi", public=True)
    if method == "GET" and path == "/v1/models":
        return Route("models")
    if path in (LORA_LOAD, LORA_UNLOAD):
        return Route("runtime_lora")
    if path.startswith(BATCH_PREFIXES):
        return Route("batch")
    if method == "POST" and path in POST_ROUTES:
        return Route("generate")
    if (found := response_ids.ROUTE.match(path)) is not None:
        return Route("stored_response", match=found)
    return None
