"""Which of vLLM's quantization methods the installed vLLM runs on this CPU, tried one by one on the tiny model.

    python scripts/cpu_quantization.py [--methods fp8 int8_per_channel_weight_only ...] [--json OUT]

Each method gets a fresh process: vLLM's offline `LLM` loads the tiny bf16 checkpoint with `quantization=METHOD`
and generates 8 tokens at temperature 0; the first layer's weight dtypes tell whether it quantized anything.
A method that needs a checkpoint quantized by its own tool (AWQ, GPTQ,
compressed-tensors, ...) fails at config time on a bf16 checkpoint; its line says so. The result is what
`deployments/vllm_adapter.CPU_QUANTIZATION` records for the CPU line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROBE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], quantization=sys.argv[2], dtype="bfloat16", max_model_len=256, enforce_eager=True,
          max_num_seqs=4, kv_cache_memory_bytes=32 << 20)
out = llm.generate(["The summit of the mountain"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print("TOKENS", list(out[0].outputs[0].token_ids), flush=True)
dtypes = llm.apply_model(lambda m: sorted({str(p.dtype).replace("torch.", "") for n, p in m.named_parameters()
                                           if "layers.0." in n and "norm" not in n and "gate.weight" not in n}))
print("DTYPES", ",".join(dtypes[0]), flush=True)
"""


def try_method(model: Path, method: str, timeout_s: int) -> dict:
    # the engine in this process, so that apply_model can read the loaded weights' dtypes
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "2",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, str(model), method],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"method": method, "ok": False, "error": f"no answer in {timeout_s} s", "s": timeout_s}
    took = round(time.monotonic() - start, 1)
    tokens = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS")]
    dtypes = [line[7:] for line in proc.stdout.splitlines() if line.startswith("DTYPES")]
    if proc.returncode == 0 and tokens:
        # ran; "quantized" only where the first layer's weights are no longer all bf16 (some methods run and
        # leave a dense model as it was: they quantize MoE experts only)
        weights = dtypes[0] if dtypes else "?"
        return {
            "method": method,
            "ok": True,
            "quantized": weights not in ("bfloat16", "?"),
            "weights": weights,
            "tokens": tokens[0][7:],
            "s": took,
        }
    lines = [
        line.strip()
        for line in (proc.stderr + proc.stdout).splitlines()
        if ("Error" in line or "error" in line) and "errors.pydantic.dev" not in line
    ]
    return {
        "method": method,
        "ok": False,
        "error": (lines[-1] if lines else f"exit {proc.returncode}")[-300:],
        "s": took,
    }


def main() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from app.clusters.tiny_model import make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="*", default=list(QUANTIZATION_METHODS))
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--arch", default="llama", help="tiny model family (mixtral: a mixture of experts)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="summit-quant-") as tmp:
        model = Path(tmp) / "tiny"
        make_tiny_model(model, arch=args.arch)
        rows = []
        for method in args.methods:
            row = try_method(model, method, args.timeout)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("runs and quantizes on this CPU:", ", ".join(r["method"] for r in rows if r.get("quantized")) or "none")
    print(
        "runs, weights left as they were:",
        ", ".join(r["method"] for r in rows if r["ok"] and not r["quantized"]) or "none",
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
