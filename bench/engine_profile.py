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

Async scheduling (GPU): each step above is timed alone (vLLM's async scheduler off: with it on a step's outputs come
back while the next one runs, so a step's time cannot be told apart). A served engine schedules asynchronously, which
hides part of each step's CPU time; `--async-runs FILE` measures only that: decode runs of the same batches with
async scheduling on, each step's time from two runs' difference (the same requests generating 8 and 8 + N tokens), and
writes them to FILE; `--async-samples FILE` then fits the hidden time (StepProfile.async_gain_s, async_gain_seq_s)
beside the steps timed alone and keeps those samples too.
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

from app.simulate.profile import StepProfile, fit, fit_async_gain, fit_error  # noqa: E402
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
        kwargs.update(
            load_format="dummy", gpu_memory_utilization=ns.gpu_memory_utilization, async_scheduling=bool(ns.async_runs)
        )
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


def run_wall(llm, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds from putting the prompts in to the last request's end (any scheduling)."""
    from vllm import SamplingParams, TokensPrompt

    eng = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"a{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=p), params)
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0


def measure_async(llm, ns: argparse.Namespace) -> list[dict]:
    """Decode steps with async scheduling on: (wall of 8 + N tokens - wall of 8 tokens) / N, the same requests."""
    import random

    rng = random.Random(1)
    top = min(ns.max_prefill, ns.max_model_len - ns.decode_tokens - 8)
    samples = []
    run_wall(llm, [[rng.randrange(10, 400) for _ in range(64)]], 4)  # warm-up
    for context in (128, top // 2):
        for b in ns.decode_batches or sorted({1, 2, max(1, ns.max_num_seqs // 2), ns.max_num_seqs}):
            prompts = [[rng.randrange(10, 400) for _ in range(context)] for _ in range(b)]
            walls = []
            for n in (8, 8 + ns.decode_tokens):
                fresh = [[rng.randrange(10, 400)] + p[1:] for p in prompts]  # no prefix-cache reuse between runs
                walls.append(run_wall(llm, fresh, n))
            step = (walls[1] - walls[0]) / ns.decode_tokens
            samples.append(
                {
                    "kind": "decode_async",
                    "prefill_tokens": 0,
                    "decode_seqs": b,
                    "context_tokens": b * (context + 8 + ns.decode_tokens // 2),
                    "step_s": step,
                }
            )
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
    p.add_argument("--async-runs", metavar="FILE", help="measure decode runs with async scheduling on into FILE (only)")
    p.add_argument("--async-samples", metavar="FILE", help="a --async-runs file: fit the time async scheduling hides")
    p.add_argument("--out")
    ns = p.parse_args()
    if not (ns.out or ns.async_runs):
        p.error("give --out (the profile) or --async-runs (async decode runs)")
    if ns.eager is None:
        ns.eager = ns.accelerator == "cpu"
    model_dir = model_dir_for(ns.accelerator, ns.preset, ns.model_dir, prefix="summit-profile-")
    ns.kv_bytes_per_token = kv_bytes_per_token(model_dir)
    llm = engine(ns, model_dir)
    if ns.async_runs:
        t0 = time.perf_counter()
        runs = measure_async(llm, ns)
        Path(ns.async_runs).write_text(json.dumps(runs, indent=2) + "\n")
        print(f"{len(runs)} async decode runs in {time.perf_counter() - t0:.0f} s:")
        for r in runs:
            print(f"  {r['decode_seqs']:>4} requests, {r['context_tokens']:>7} context: {r['step_s'] * 1000:.2f} ms")
        return
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
    if ns.async_samples:
        runs = json.loads(Path(ns.async_samples).read_text())
        profile.async_gain_s, profile.async_gain_seq_s = fit_async_gain(profile, runs)
        profile.samples += runs
        profile.about += (
            f"; {len(runs)} decode runs with async scheduling on, the hidden time fitted as "
            f"{profile.async_gain_s * 1000:.2f} ms + {profile.async_gain_seq_s * 1e6:.2f} us a request "
            f"(median error {fit_error(profile, runs, timed_alone=False):.1%})"
        )
    profile.save(ns.out)
    print(json.dumps(coef, indent=2), f"\n{profile.about}")


if __name__ == "__main__":
    main()
