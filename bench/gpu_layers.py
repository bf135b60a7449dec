"""Which layer breaks a multi-GPU engine? TP=2 through plain vLLM first, then through Ray outside Serve.

    python bench/gpu_layers.py MODEL_DIR [--tp 2] [--pp 1]

1. `vllm.LLM(tensor_parallel_size=2)` on vLLM's own multiprocessing executor, no Ray;
2. the same on vLLM's Ray executor inside a placement group made with Ray's API (no Serve), as Summit's replica
   hands it over;
each with the settings every Summit GPU engine gets (deployments/engine/args.py: multicast-off environment,
FlashInfer all-reduce fusion off). Each layer runs in a subprocess of its own and prints OK with its tokens or
FAIL with the error's last lines. Dummy weights, token-id prompts: no tokenizer or checkpoint needed.
Rehearsal on CPU: `SUMMIT_VLLM_CPU_RAY=1 LAYERS_RAY_GPUS=2 RAY_AUTH_MODE=disabled VLLM_CPU_KVCACHE_SPACE=1 ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deployments.engine import NO_NVLINK_MULTICAST_ENV, engine_kwargs  # noqa: E402

LAYER = r"""
import json, os, sys, tempfile
from vllm import LLM, SamplingParams
kwargs = json.loads(sys.argv[1])
if sys.argv[2] == "ray-pg":
    import ray
    from ray.util.placement_group import placement_group
    # a private local Ray; on CPU (rehearsal through Summit's platform plugin) its worker slots are declared
    ray.init(num_gpus=int(os.environ.get("LAYERS_RAY_GPUS", "0")) or None, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="summit-layers-"))
    n = kwargs["tensor_parallel_size"] * kwargs["pipeline_parallel_size"]
    group = placement_group([{"GPU": 1, "CPU": 1}] * n, strategy="STRICT_PACK")
    ray.get(group.ready())
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # the engine core joins this cluster
    # This driver is not a Ray actor, so vLLM would fork its engine core, which then inherits a Ray connection that
    # no longer works and waits forever (2 x H200, 2026-11-24: "Ray is already initialized", no worker started).
    # A Serve replica is an actor: vLLM spawns there by itself (vllm.utils.system_utils._maybe_force_spawn).
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    kwargs["distributed_executor_backend"] = "ray"
    # what deployments/engine/app.py does with the replica's placement group
    from vllm.engine.arg_utils import EngineArgs
    config = EngineArgs(**kwargs).create_engine_config()
    config.parallel_config.placement_group = group
    from vllm.v1.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_vllm_config(config)
    engine.add_request("r0", {"prompt_token_ids": [1, 5, 9, 13]},
                       SamplingParams(max_tokens=8, temperature=0, detokenize=False))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
else:
    kwargs["distributed_executor_backend"] = "mp"
    llm = LLM(**kwargs)
    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}],
                       SamplingParams(max_tokens=8, temperature=0, detokenize=False))
    tokens = list(out[0].outputs[0].token_ids)
print("TOKENS", tokens)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layers", nargs="+", default=["mp", "ray-pg"])
    p.add_argument("--timeout", type=float, default=400)
    ns = p.parse_args()
    given = {
        "model": ns.model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": 512,
        "gpu_memory_utilization": 0.3,
    }
    kwargs = engine_kwargs(given, "gpu", ns.tp, ns.pp)
    kwargs.pop("distributed_executor_backend", None)
    env = {**os.environ, **NO_NVLINK_MULTICAST_ENV}
    for layer in ns.layers:
        log = Path(os.environ.get("OUT", ".")) / f"layer-{layer}.log"  # written as it runs: a hang still leaves it
        with log.open("w") as f:
            try:
                rc = subprocess.run(
                    [sys.executable, "-c", LAYER, json.dumps(kwargs), layer],
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=ns.timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        out = log.read_text(errors="replace")
        tokens = [line for line in out.splitlines() if line.startswith("TOKENS")]
        print(f"layer {layer}: " + (f"OK {tokens[-1]}" if rc == 0 and tokens else f"FAIL rc={rc}"))
        if "mnnvl" in out:
            print(f"layer {layer}: WARNING the log mentions mnnvl")
        if rc != 0 or not tokens:
            print("\n".join(out.splitlines()[-40:]))


if __name__ == "__main__":
    main()
