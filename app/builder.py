"""`app.builder:build_app` — the Serve application for a Summit YAML's `args:`."""

from __future__ import annotations

import logging
import time
from typing import Any

from ray import serve
from ray.serve import Application

from app.config import SummitConfig
from app.deployment_options import ingress_deployment_options, llm_deployment_options, replica_bundles
from app.placement import unplaceable
from deployments.auth import load_api_keys
from deployments.ingress import OpenAIIngress
from deployments.llm_server import LLMServer

logger = logging.getLogger("ray.serve")


def wait_until_placeable(options: dict[str, dict[str, Any]], wait_s: float, poll_s: float = 5.0) -> None:
    """Wait (up to `wait_s`) until the cluster's alive nodes could hold one replica of each model, else raise naming
    the model and the missing resource. Serve itself would leave such a replica pending without end."""
    import ray

    if not ray.is_initialized() or wait_s < 0:
        return
    deadline, next_log = time.monotonic() + wait_s, time.monotonic()
    while True:
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        problems = [f"model {name!r}: one replica {why}" for name, opts in options.items()
                    if (why := unplaceable(*replica_bundles(opts), nodes))]
        if not problems:
            return
        if time.monotonic() >= deadline:
            raise ValueError(
                f"the Ray cluster cannot place {'; '.join(problems)} (waited {wait_s:g} s for nodes). Fix: add nodes with "
                "those resources, or lower the model's tensor_parallel_size / pipeline_parallel_size / deployment.num_cpus; "
                "or raise `placement_wait_s` (-1: wait without end) if nodes are still to join.")
        if time.monotonic() >= next_log:
            logger.warning("Waiting up to %.0f s more for Ray nodes: %s", deadline - time.monotonic(), "; ".join(problems))
            next_log = time.monotonic() + 30
        time.sleep(min(poll_s, max(0.05, deadline - time.monotonic())))


def build_app(args: dict[str, Any]) -> Application:
    """Validate the YAML args once, check the cluster can hold the models, then bind one engine deployment per model
    behind one ingress."""
    config = SummitConfig.model_validate(args)
    options = {m.name: llm_deployment_options(m) for m in config.models}
    wait_until_placeable(options, config.placement_wait_s)
    servers = {
        m.name: serve.deployment(LLMServer).options(**options[m.name]).bind(m, m.resolved_source())
        for m in config.models
    }
    if config.auth is not None:  # fail the deploy now, naming the key, rather than each ingress replica's start
        load_api_keys(config.auth.api_keys_env, config.auth.api_keys_file)
    ingress = serve.deployment(OpenAIIngress).options(**ingress_deployment_options(config.ingress))
    return ingress.bind(servers, config.auth)
