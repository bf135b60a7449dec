"""Sustained overload: `clients` streams at once, each sending again as soon as it is answered, for `duration_s`
(4x the capacity: replicas x (max_ongoing_requests + max_queued_requests)); then how soon the model answers again.

    python bench/overload.py --duration 60        # the test_scaling app (2 replicas max, 4 running + 2 queued each)
                                                  # on a private loopback cluster; prints the figures as JSON

Figures: answers by status, how fast refusals come (p50/p99 ms), whether every refusal had Retry-After and an
OpenAI body, hung clients (no answer within the bound), seconds from the burst's end to the first 200.
tests/cpu/test_scaling.py runs it for 15 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BOUND_S = 120.0


def overload(
    base_url: str, model: str, clients: int, duration_s: float, tokens: int = 64, burst_over=lambda: None
) -> dict:
    """The burst's figures; `burst_over()` is called when its clock ends (the clients then finish what they had sent:
    a test that slowed the engines for the burst lets them go on there)."""
    lock = threading.Lock()
    statuses: Counter = Counter()
    refusal_ms: list[float] = []
    bad_refusals: list[str] = []
    cuts: list[str] = []  # what a cut request had got: its status, the bytes read, the error
    hung = 0
    # Every client is made before the clock starts and sends at least once: on a loaded 2-core box, making 48 HTTP
    # clients inside the burst took longer than a 15-s burst (a CI run: 3 requests sent, none refused).
    https = [httpx.Client(base_url=base_url, timeout=httpx.Timeout(BOUND_S, connect=10)) for _ in range(clients)]
    stop = time.monotonic() + duration_s

    def client(i: int) -> None:
        nonlocal hung
        body = {"model": model, "prompt": f"Client {i} asks", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        with https[i] as http:
            while True:
                t0 = time.monotonic()
                seen = {"status": None, "bytes": 0}
                try:
                    with http.stream("POST", "/v1/completions", json=body) as r:
                        seen["status"] = r.status_code
                        if r.status_code in (429, 503):
                            took = (time.monotonic() - t0) * 1000
                            text = r.read()
                            ok = (
                                "retry-after" in r.headers
                                and json.loads(text).get("error", {}).get("code") == r.status_code
                            )
                            with lock:
                                refusal_ms.append(took)
                                if not ok:
                                    bad_refusals.append(f"{r.status_code} {r.headers} {text[:200]!r}")
                            time.sleep(min(float(r.headers.get("retry-after", 1)), 0.5))  # an impatient client
                        else:
                            for line in r.iter_lines():
                                seen["bytes"] += len(line) + 1
                        with lock:
                            statuses[r.status_code] += 1
                except httpx.TimeoutException:
                    with lock:
                        hung += 1
                except httpx.HTTPError as e:
                    with lock:
                        statuses[f"cut: {type(e).__name__}"] += 1
                        took = time.monotonic() - t0
                        cuts.append(f"status {seen['status']}, {seen['bytes']} bytes read in {took:.1f} s: {e}"[:300])
                if time.monotonic() >= stop:
                    break

    over = threading.Timer(max(0.0, stop - time.monotonic()), burst_over)
    over.start()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    over.join()
    end = time.monotonic()
    recovered = None
    while time.monotonic() - end < 60:
        try:
            r = httpx.post(
                base_url + "/v1/completions", timeout=30, json={"model": model, "prompt": "after", "max_tokens": 2}
            )
            if r.status_code == 200:
                recovered = round(time.monotonic() - end, 2)
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    q = statistics.quantiles(refusal_ms, n=100) if len(refusal_ms) >= 2 else [float("nan")] * 99
    return {
        "clients": clients,
        "duration_s": duration_s,
        "answers": {str(k): v for k, v in statuses.items()},
        "refusals": len(refusal_ms),
        "refusal_p50_ms": round(q[49], 1),
        "refusal_p99_ms": round(q[98], 1),
        "bad_refusals": bad_refusals[:5],
        "cuts": cuts[:5],
        "hung": hung,
        "recovered_s": recovered,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running Summit (default: the test_scaling app, started privately)")
    parser.add_argument("--model", default="tiny-scale")
    parser.add_argument("--clients", type=int, default=48, help="4x the test app's capacity of 2 x (4 + 2)")
    parser.add_argument("--duration", type=float, default=60)
    args = parser.parse_args()
    if args.base_url:
        print(json.dumps(overload(args.base_url, args.model, args.clients, args.duration), indent=1))
        return 0
    import tempfile

    from app.clusters.tiny_model import make_tiny_model
    from tests.cpu.engine_apps import deployed
    from tests.cpu.test_scaling import FAST_METRICS, scaling_models

    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="summit-overload-")) / "tiny-llama", max_len=2048)
    with deployed(scaling_models(), model_dir, env=FAST_METRICS, haproxy=True) as cluster:
        print(json.dumps(overload(cluster.base_url, args.model, args.clients, args.duration), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
