"""Engine features on one GPU, one run: Summit's 8B configs as their YAML sets the engine (dummy weights).

    python bench/engine_features.py --model-dir DIR [--draft-dir DIR] [--variants bf16 fp8 draft] --json OUT

Variants of `serve_configs/llama8b-fp8.yaml`'s model entry (its engine_kwargs, validated and completed by Summit's
config as a replica would be):
  fp8    the YAML as shipped: `quantization: fp8`, `kv_cache_dtype: fp8`
  bf16   the same without quantization (bf16 weights and KV)
  draft  bf16 + `speculative_config: {method: draft_model, model: DRAFT, num_speculative_tokens: 3}` (a Llama 3.2 1B
         shape; with dummy weights the draft and the target disagree, so the acceptance rate is near zero: the run
         shows that the config runs and keeps the greedy output, not a speed-up)
Each variant runs in its own process (vLLM's offline `LLM`, so the engine alone is measured): out tok/s at 1 and
256 sequences (128-token prompts, 256 tokens out), TTFT (one-token requests, one at a time), the greedy tokens of 4
prompts (compared across variants: fp8 changes them, a draft model must not), and vLLM's speculative counters.
Rehearsal on CPU with the tiny model: `--accelerator cpu --variants bf16 draft --max-model-len 1024`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RUN = r"""
import json, sys, time
from vllm import LLM, SamplingParams
kwargs, spec = json.loads(sys.argv[1]), json.loads(sys.argv[2])
start = time.monotonic()
llm = LLM(disable_log_stats=False, **kwargs)
ready_s = time.monotonic() - start
vocab = llm.llm_engine.model_config.get_vocab_size()
def prompts(n, length, salt):
    return [{"prompt_token_ids": [(7919 * (i + salt) + 104729 * j) % (vocab - 1000) + 500 for j in range(length)]}
            for i in range(n)]
greedy = llm.generate(prompts(4, 32, 1),
                      SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, detokenize=False))
row = {"ready_s": round(ready_s, 1), "greedy": [list(o.outputs[0].token_ids) for o in greedy], "runs": []}
ttft = []
for p in prompts(8, spec["prompt_len"], 2):
    t = time.monotonic()
    llm.generate([p], SamplingParams(max_tokens=1, temperature=0, detokenize=False), use_tqdm=False)
    ttft.append((time.monotonic() - t) * 1000)
for n in spec["concurrency"]:
    batch = prompts(n, spec["prompt_len"], 100 + n)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True, detokenize=False)
    t = time.monotonic()
    outs = llm.generate(batch, params, use_tqdm=False)
    took = time.monotonic() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row["runs"].append({"concurrency": n, "out_tok_s": round(tokens / took, 1), "seconds": round(took, 2)})
row["ttft_ms"] = sorted(ttft)
metrics = {}
for m in llm.get_metrics():
    if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
        metrics[m.name] = metrics.get(m.name, 0) + m.value
row["spec"] = metrics
print("ROW " + json.dumps(row), flush=True)
"""


def variant_kwargs(name: str, args) -> dict:
    """The YAML's model entry, changed only as the variant says, through Summit's own config."""
    import yaml

    from app.build.engine_checks import load_config
    from deployments.engine import engine_args

    app_args = yaml.safe_load((REPO / "serve_configs/llama8b-fp8.yaml").read_text())["applications"][0]["args"]
    (entry,) = app_args["models"]
    entry.update(source=str(args.model_dir), accelerator=args.accelerator)
    engine = entry["engine_kwargs"]
    engine.update(load_format="dummy", max_model_len=args.max_model_len)
    if name != "fp8" or args.accelerator == "cpu":
        engine.pop("quantization", None)
        engine.pop("kv_cache_dtype", None)
    if args.accelerator == "cpu":
        engine.pop("gpu_memory_utilization", None)
        engine.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_num_seqs=max(args.concurrency))
    if name == "draft":
        engine["speculative_config"] = {
            "method": "draft_model",
            "model": str(args.draft_dir),
            "num_speculative_tokens": 3,
        }  # loaded as the target is (dummy)
    model = load_config({"models": [entry]}).models[0]
    return {"model": str(args.model_dir), **engine_args(model)}


def run_variant(name: str, args) -> dict:
    from deployments.engine import NO_NVLINK_MULTICAST_ENV

    kwargs = variant_kwargs(name, args)
    spec = {"concurrency": args.concurrency, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    env = {**os.environ, **NO_NVLINK_MULTICAST_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(kwargs), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=args.timeout,
    )
    rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return {"variant": name, "error": "\n".join(tail)}
    return {"variant": name, "engine_kwargs": kwargs, **json.loads(rows[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--draft-dir", type=Path)
    ap.add_argument("--variants", nargs="+", default=["bf16", "fp8", "draft"])
    ap.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    for name in args.variants:
        result = run_variant(name, args)
        print(json.dumps({k: v for k, v in result.items() if k not in ("engine_kwargs", "greedy")}), flush=True)
        results.append(result)
    base = next((r for r in results if r["variant"] == "bf16" and "greedy" in r), None)
    rows = []
    for r in results:
        if "runs" not in r:
            continue
        if base is not None:
            r["greedy_same_as_bf16"] = r["greedy"] == base["greedy"]
        for run in r["runs"]:
            ratio = ""
            if base is not None:
                (b,) = [x for x in base["runs"] if x["concurrency"] == run["concurrency"]]
                ratio = f"  {run['out_tok_s'] / b['out_tok_s']:.2f}x bf16"
            print(f"{r['variant']:6} c={run['concurrency']:<4} {run['out_tok_s']:>9.1f} tok/s{ratio}")
            rows.append(
                {
                    "peer": f"summit-engine-{r['variant']}",
                    "concurrency": run["concurrency"],
                    "out_tok_s": run["out_tok_s"],
                    "ttft_p50_ms": round(statistics.median(r["ttft_ms"]), 1),
                    "ttft_p99_ms": round(max(r["ttft_ms"]), 1),
                }
            )
        if r["spec"]:
            drafted = r["spec"].get("vllm:spec_decode_num_draft_tokens", 0)
            accepted = r["spec"].get("vllm:spec_decode_num_accepted_tokens", 0)
            print(
                f"{r['variant']}: {accepted:.0f} of {drafted:.0f} drafted tokens accepted; greedy output same as "
                f"bf16: {r.get('greedy_same_as_bf16')}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        args.json.with_suffix(".full.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
