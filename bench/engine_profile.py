"""Measure an engine's step time for `summit simulate` (app/simulate/profile.py) and store it as data.

    python bench/engine_profile.py --out bench/results/profile-cpu-tiny-2026-11-29.json        # the tiny model on CPU
    python bench/engine_profile.py --accelerator gpu --preset llama-3.1-8b --out bench/results/profile-h200-8b.json

vLLM's own engine (`vllm.LLM`, its engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) with the serving
settings of the model (eager on CPU, prefix caching off so every prompt token is computed); each `step()` is timed and
its batch is known from the requests put in: prompts alone of 32 to `--max-prefill` tokens (prefill steps), then
1 to `--max-num-seqs` requests decoding at two context lengths, then decodes beside a prefill. The coefficients of
StepProfile are fitted to all of them (least squares), and the file keeps the samples, the engine's settings and the
fit's median error. `--start-s`: the replica's cold start the simulator charges (measured elsewhere: the routing and
autoscaling runs in bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from app.simulate.profile import StepProfile, fit, fit_error  # noqa: E402
from bench.engines import kv_bytes_per_token, model_dir_for  # noqa: E402


def engine(ns: argparse.Namespace, model_dir: str):
    from vllm import LLM

    kwargs = {
        "model": model_dir,
        "max_model_len": ns.max_model_len,
        "max_num_seqs": ns.max_num_seqs,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "enable_prefix_caching": False,
        "enforce_eager": ns.eager,
    }
    if ns.accelerator == "cpu":
        # room for every measured batch (the stored kv_tokens is the simulated replica's: --kv-cache-tokens)
        kv = max(ns.kv_cache_tokens, 16384)
        kwargs.update(dtype="bfloat16", kv_cache_memory_bytes=kv * ns.kv_bytes_per_token)
    else:
        # one step at a time: vLLM's async scheduler returns a step's outputs while the next runs on the GPU, which
        # shifts each measured time onto another step (seen: a 4,000-token prefill step read 16 ms on an H200)
        kwargs.update(load_format="dummy", gpu_memory_utilization=ns.gpu_memory_utilization, async_scheduling=False)
    return LLM(**kwargs)


def timed_steps(llm, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, int, int, int]]:
    """Put the prompts in and step to the end: (seconds, prefill tokens, decoding requests, context tokens) a step,
    as the batch is known from the requests' progress (each prompt fits the step's budget whole)."""
    from vllm import SamplingParams, TokensPrompt

    eng = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=p), params)
    generated = {i: 0 for i in range(len(prompts))}
    pending = list(range(len(prompts)))  # not yet prefilled, in order
    steps = []
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    while eng.has_unfinished_requests():
        running = [i for i in generated if 0 < generated[i] < max_tokens]
        prefill, room = [], budget - len(running)
        while pending and len(prompts[pending[0]]) <= room and len(running) + len(prefill) < llm_max_seqs(llm):
            room -= len(prompts[pending[0]])
            prefill.append(pending.pop(0))
        context = sum(len(prompts[i]) + generated[i] for i in running + prefill)
        t0 = time.perf_counter()
        eng.step()
        steps.append((time.perf_counter() - t0, sum(len(prompts[i]) for i in prefill), len(running), context))
        for i in running + prefill:
            generated[i] += 1
    return steps


def kv_tokens_of(llm) -> int | None:
    """The engine's KV cache in tokens, as vLLM sized it (GPU blocks x block size)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return (cache.num_gpu_blocks or 0) * cache.block_size or None


def llm_max_seqs(llm) -> int:
    return llm.llm_engine.vllm_config.scheduler_config.max_num_seqs


def measure(llm, ns: argparse.Namespace) -> list[dict]:
    import random

    rng = random.Random(0)
    vocab = 400

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    samples = []

    def keep(steps, kind):
        for s, p, d, c in steps[1:] if kind == "decode" else steps:
            samples.append({"kind": kind, "prefill_tokens": p, "decode_seqs": d, "context_tokens": c, "step_s": s})

    timed_steps(llm, [prompt(64)], 4)  # warm-up
    n, top = 32, min(ns.max_prefill, ns.max_model_len - ns.decode_tokens)
    while n <= top:
        for _ in range(ns.repeats):
            keep(timed_steps(llm, [prompt(n)], 1), "prefill")
        n = top if n < top < 2 * n else 2 * n
    for context in (128, top // 2):
        for b in ns.decode_batches or sorted({1, 2, max(1, ns.max_num_seqs // 2), ns.max_num_seqs}):
            steps = timed_steps(llm, [prompt(context) for _ in range(b)], ns.decode_tokens)
            keep([s for s in steps if s[1] == 0 and s[2] == b], "decode")
    for b in sorted({1, max(1, ns.max_num_seqs // 2)}):
        steps = timed_steps(llm, [prompt(256) for _ in range(b)] + [prompt(top // 2)], 8)
        keep([s for s in steps if s[1] and s[2]], "mixed")
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--preset", default="llama-3.1-8b", help="GPU: the model shape (random weights)")
    p.add_argument("--model-dir", help="default: the tiny model (CPU) or the preset's config (GPU)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill", type=int, default=2048)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--start-s", type=float, default=None, help="the replica's cold start to store")
    p.add_argument("--name", default=None)
    p.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's eager mode (default: on CPU, as the shipped CPU config; off on GPUs: CUDA graphs)",
    )
    p.add_argument("--decode-batches", type=int, nargs="+", default=None, help="decoding requests measured")
    p.add_argument("--out", required=True)
    ns = p.parse_args()
    if ns.eager is None:
        ns.eager = ns.accelerator == "cpu"
    model_dir = model_dir_for(ns.accelerator, ns.preset, ns.model_dir, prefix="summit-profile-")
    ns.kv_bytes_per_token = kv_bytes_per_token(model_dir)
    llm = engine(ns, model_dir)
    t0 = time.perf_counter()
    samples = measure(llm, ns)
    coef = fit(samples)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    profile = StepProfile(
        name=ns.name or f"{ns.accelerator}-{Path(model_dir).name}",
        **coef,
        block_size=block,
        kv_tokens=ns.kv_cache_tokens if ns.accelerator == "cpu" else kv_tokens_of(llm),
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        start_s=ns.start_s if ns.start_s is not None else 60.0,
        about=f"{len(samples)} steps of vLLM's engine ({ns.accelerator}, {Path(model_dir).name}), "
        f"measured in {time.perf_counter() - t0:.0f} s",
        samples=samples,
    )
    err = fit_error(profile, samples)
    profile.about += f"; the fit's median error {err:.1%}"
    profile.save(ns.out)
    print(json.dumps(coef, indent=2), f"\nmedian fit error {err:.1%}; {len(samples)} steps")


if __name__ == "__main__":
    main()
