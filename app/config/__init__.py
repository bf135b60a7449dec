"""The Serve YAML's `args:` for `app.build:build_app`, as one pydantic root model (`SummitConfig`): the lowest layer.

Unknown keys are rejected with the key named. The schema imports no engine: what only the installed vLLM can answer
(engine kwargs against the fields of vLLM's own `AsyncEngineArgs`, its OpenAI server's options, its KV connectors) is
asked through the validation context's `EngineChecks` (app/config/checks.py), which the control plane passes where a
YAML is validated for real (`app.build.engine_checks.load_config`).

Modules: env (`$VAR` expansion), options (deployment, routing, ingress, auth, stream resume), model (a model),
disaggregation, root (SummitConfig), lora, batch, monitoring, autoscaling, presets, checks.
"""

from app.config.batch import BatchOptions
from app.config.checks import EngineChecks
from app.config.disaggregation import DisaggregationOptions, PDSide
from app.config.env import expand_env
from app.config.lora import LORA_ENGINE_KEYS, Adapter, LoraOptions
from app.config.model import DEFAULT_MAX_NUM_SEQS, ModelConfig
from app.config.monitoring import MonitoringOptions
from app.config.options import (
    AuthOptions,
    DeploymentOptions,
    IngressOptions,
    RateLimitOptions,
    RoutingOptions,
    StreamResumeOptions,
)
from app.config.root import SummitConfig

__all__ = [
    "DEFAULT_MAX_NUM_SEQS",
    "LORA_ENGINE_KEYS",
    "Adapter",
    "AuthOptions",
    "BatchOptions",
    "DeploymentOptions",
    "DisaggregationOptions",
    "EngineChecks",
    "IngressOptions",
    "LoraOptions",
    "ModelConfig",
    "MonitoringOptions",
    "PDSide",
    "RateLimitOptions",
    "RoutingOptions",
    "StreamResumeOptions",
    "SummitConfig",
    "expand_env",
]
