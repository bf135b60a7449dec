"""A small OpenAI streaming load generator: output tok/s and TTFT percentiles for one concurrency level."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import time
from dataclasses import dataclass, field

import httpx


def percentile(data: list[float], q: float) -> float:
    """Nearest-rank percentile `q` (0-100) of `data`; NaN when empty."""
    if not data:
        return float("nan")
    data = sorted(data)
    return data[min(len(data) - 1, int(round(q / 100 * (len(data) - 1))))]


@dataclass
class LoadResult:
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float]
    errors: int
    # CPU seconds the server's whole process tree used during the load, engine included
    cpu_s: float | None = None
    # ... of which the serving processes' (all but vLLM's engine core and workers: the HTTP server, Summit's replica,
    # Ray's daemons, HAProxy): the work a server adds around the engine
    serving_cpu_s: float | None = None
    # ... the largest shares of it, by process role
    cpu_breakdown: list[tuple[str, float]] | None = None
    # time per output token after the first, per request (decode speed as each client saw it)
    tpot_s: list[float] | None = None
    # extra figures a benchmark adds to its row (bench/pd.py: the decode replica's phases)
    extra: dict = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def ttft_pct(self, q: float) -> float:
        return percentile(self.ttft_s, q)

    def row(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "errors": self.errors,
            "out_tok_s": round(self.tok_per_s, 1),
            "ttft_p50_ms": round(self.ttft_pct(50) * 1000, 1),
            "ttft_p99_ms": round(self.ttft_pct(99) * 1000, 1),
            "wall_s": round(self.wall_s, 2),
            **({} if self.serving_cpu_s is None else {"serving_cpu_s_per_1k_tok": self.serving_cpu_per_1k_tok()}),
            **({} if self.cpu_s is None else {"cpu_s_per_1k_tok": self.cpu_per_1k_tok()}),
            **(
                {}
                if not self.tpot_s
                else {
                    "tpot_p50_ms": round(percentile(self.tpot_s, 50) * 1000, 2),
                    "tpot_p99_ms": round(percentile(self.tpot_s, 99) * 1000, 2),
                }
            ),
            **self.extra,
        }

    def cpu_per_1k_tok(self) -> float | None:
        """CPU seconds of the whole server (engine included) per 1,000 output tokens."""
        return _per_1k(self.cpu_s, self.output_tokens)

    def serving_cpu_per_1k_tok(self) -> float | None:
        """CPU seconds of the serving processes (all but the engine's) per 1,000 output tokens."""
        return _per_1k(self.serving_cpu_s, self.output_tokens)


def _per_1k(seconds: float | None, tokens: int) -> float | None:
    return None if seconds is None or not tokens else round(seconds / tokens * 1000, 3)


# vLLM's engine processes (their titles): the engine core and its workers, the same in every peer
ENGINE_ROLES = ("VLLM::EngineCore", "VLLM::Worker")


def is_engine_role(label: str) -> bool:
    return label.startswith(ENGINE_ROLES)


def tree_cpu_s(root_pid: int) -> dict[tuple[int, float, str], float]:
    """User + system CPU seconds of each live process in `root_pid`'s tree, keyed by (pid, start time, role)."""
    import psutil

    out = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            t = proc.cpu_times()
            out[(proc.pid, proc.create_time(), _process_label(proc))] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def _process_label(proc) -> str:
    """A process's role, for the CPU breakdown: Ray's actor title (ray::ServeReplica:..., ray::HAProxyManager...),
    a vLLM process title (VLLM::EngineCore), or the program's name (gcs_server, raylet, haproxy, python)."""
    name = proc.name()
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001
        cmd = []
    first = cmd[0] if cmd else name
    if first.startswith(("ray::", "VLLM::")):
        return first.split(".")[0].split(" ")[0]
    if name in ("python", "python3") and len(cmd) > 1:
        script = next((c for c in cmd[1:] if c.endswith(".py") or c.startswith("vllm.")), cmd[1])
        return f"python {script.rsplit('/', 1)[-1]}"
    return name


def cpu_by_process(before: dict, after: dict, top: int = 8) -> list[tuple[str, float]]:
    """The processes' roles that used the most CPU seconds between two `tree_cpu_s` snapshots."""
    by_label: dict[str, float] = {}
    for key, t in after.items():
        by_label[key[2]] = by_label.get(key[2], 0.0) + t - before.get(key, 0.0)
    return sorted(by_label.items(), key=lambda kv: -kv[1])[:top]


def cpu_used_s(before: dict, after: dict, serving_only: bool = False) -> float:
    """CPU seconds between two `tree_cpu_s` snapshots (a process started in between counts whole; one that ended in
    between is missed); `serving_only`: all but the engine's processes."""
    return sum(t - before.get(key, 0.0) for key, t in after.items() if not (serving_only and is_engine_role(key[2])))


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict, timing: dict | None = None
) -> tuple[float | None, int, str | None]:
    """One streamed completion: (TTFT, completion tokens or -1 on an error status, replica that answered). `timing`,
    if given, gets "tpot": seconds per output token after the first ((last text - first text) / (tokens - 1))."""
    start = time.perf_counter()
    ttft, tokens, last = None, 0, None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            body = (await r.aread())[:300]
            if timing is not None:
                timing["error"] = f"{r.status_code} {body.decode(errors='replace')}"
            return None, -1, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                last = time.perf_counter() - start
                if ttft is None:
                    ttft = last
        if timing is not None and ttft is not None and tokens > 1:
            timing["tpot"] = (last - ttft) / (tokens - 1)
        return ttft, tokens, r.headers.get("x-summit-replica")


async def run_load(
    base_url: str | list[str], model: str | list[str], prompts: list[str], concurrency: int, max_tokens: int
) -> LoadResult:
    """Send every prompt once (completions, streamed, ignore_eos) with `concurrency` in flight. With several models,
    prompt i asks model i mod n; with as many base URLs as models, model i goes to URL i (one server per model)."""
    models = [model] if isinstance(model, str) else list(model)
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((p, models[i % len(models)], urls[i % len(models) % len(urls)] + "/v1/completions"))
    ttfts: list[float] = []
    tpots: list[float] = []
    totals = {"tokens": 0, "errors": 0}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker():
            while not queue.empty():
                prompt, model_name, url = queue.get_nowait()
                body = {
                    "model": model_name,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "stream": True,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream_options": {"include_usage": True},
                }
                timing: dict = {}
                try:
                    ttft, tokens, _ = await stream_completion(client, url, body, timing)
                except httpx.HTTPError as e:
                    ttft, tokens = None, -1
                    timing["error"] = repr(e)
                if "error" in timing and not totals["errors"]:  # say why once per run: a bench without it hides it
                    print(f"  first failed request: {timing['error']}", file=sys.stderr, flush=True)
                if "tpot" in timing:
                    tpots.append(timing["tpot"])
                if tokens < 0:
                    totals["errors"] += 1
                    continue
                totals["tokens"] += tokens
                if ttft is not None:
                    ttfts.append(ttft)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return LoadResult(concurrency, len(prompts), totals["tokens"], wall, ttfts, totals["errors"], tpot_s=tpots)


def _load_in_process(args: tuple) -> tuple[int, list[float], int, float, float, list[float]]:
    base_url, model, prompts, concurrency, max_tokens, start_at = args
    time.sleep(max(0.0, start_at - time.time()))  # every client process starts at once
    t0 = time.time()
    r = asyncio.run(run_load(base_url, model, prompts, concurrency, max_tokens))
    return r.output_tokens, r.ttft_s, r.errors, t0, t0 + r.wall_s, r.tpot_s


def run_load_processes(
    base_url: str | list[str],
    model: str | list[str],
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    processes: int,
) -> LoadResult:
    """`run_load` spread over `processes` client processes (one asyncio client tops out near one core: ~10k tok/s
    of SSE on the GPU host), prompts and streams dealt out evenly; wall time from the first start to the last end."""
    processes = max(1, min(processes, concurrency))
    if processes == 1:
        return asyncio.run(run_load(base_url, model, prompts, concurrency, max_tokens))
    start_at = time.time() + 2.0
    jobs = [
        (
            base_url,
            model,
            prompts[i::processes],
            concurrency // processes + (i < concurrency % processes),
            max_tokens,
            start_at,
        )
        for i in range(processes)
    ]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.map(_load_in_process, jobs)
    wall = max(p[4] for p in parts) - min(p[3] for p in parts)
    return LoadResult(
        concurrency,
        len(prompts),
        sum(p[0] for p in parts),
        wall,
        [t for p in parts for t in p[1]],
        sum(p[2] for p in parts),
        tpot_s=[t for p in parts for t in p[5]],
    )


def make_prompts(n: int, words: int, seed: int = 0, distinct: bool = False) -> list[str]:
    """`n` prompts of `words` words. They share long runs (prefix caching pays, as in chat traffic); `distinct` puts a
    unique tag first so no two share even their first KV block (prefill-heavy load, as in bench/pd.py)."""
    vocab = "summit ridge valley river cloud storm north south peak trail rope camp ice rock snow wind".split()
    out = []
    for i in range(n):
        body = " ".join(vocab[(i * 7 + j * 3 + seed) % len(vocab)] for j in range(words))
        out.append(f"#{seed}.{i} {body}" if distinct else f"{body} #{i}")
    return out


def summarize(rows: dict[str, LoadResult]) -> str:
    lines = [f"{'peer':<14}{'conc':>6}{'tok/s':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'errors':>8}"]
    for name, r in rows.items():
        lines.append(
            f"{name:<14}{r.concurrency:>6}{r.tok_per_s:>10.1f}{r.ttft_pct(50) * 1000:>13.1f}"
            f"{r.ttft_pct(99) * 1000:>13.1f}{r.errors:>8}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # quick manual use: python bench/loadgen.py http://127.0.0.1:8000 tiny-llama
    import sys

    res = asyncio.run(run_load(sys.argv[1], sys.argv[2], make_prompts(64, 16), 16, 64))
    print(json.dumps(res.row()))
