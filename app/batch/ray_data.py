"""`summit batch --ray-data`: a batch file as a Ray Data job, for jobs larger than one replica: `map_batches` over
engine actors (one per replica the model's YAML asks for, each owning a vLLM AsyncLLM and vLLM's own OpenAI app in
its process, as a Serve replica does), on every GPU of the cluster the job may take. Same input lines, same output
format, same resumable output files as the Serve path (app/batch/offline.py); no Serve, no HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from app.batch.progress import Progress
from app.config import ModelConfig, SummitConfig
from deployments.batch.lines import Line, grouped, result_line

# lines one engine actor takes at a time (all of them run concurrently in its engine)
BATCH_SIZE = 64
# how long the engine actors may take to load their models (405B from a shared filesystem: many minutes)
ENGINE_START_TIMEOUT_S = 3600


class EngineWorker:
    """A Ray Data actor: one engine and vLLM's OpenAI app, answering a block of lines at once."""

    def __init__(self, model_json: str, source: str):
        from deployments import engine

        model = ModelConfig.model_validate_json(model_json)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="engine-loop", daemon=True).start()
        args = engine.serve_namespace(source, model.name, engine.engine_args(model), model.frontend_kwargs)
        self._engine_app = asyncio.run_coroutine_threadsafe(engine.start_engine_app(args), self._loop).result()
        self._worker = f"{os.uname().nodename}:{os.getpid()}"

    def __call__(self, rows: dict) -> dict:
        lines = [
            Line(int(n), str(c), str(u), json.loads(b))
            for n, c, u, b in zip(rows["number"], rows["custom_id"], rows["url"], rows["body"])
        ]
        started = time.time()
        answers = asyncio.run_coroutine_threadsafe(self._all(lines), self._loop).result()
        n = len(answers)
        return {
            "custom_id": [a[0] for a in answers],
            "ok": [a[1] for a in answers],
            "result": [json.dumps(a[2]) for a in answers],
            "tokens": [a[3] for a in answers],
            "worker": [self._worker] * n,
            "started": [started] * n,
            "ended": [time.time()] * n,
        }

    async def _all(self, lines: list[Line]) -> list[tuple[str, bool, dict, int]]:
        return list(await asyncio.gather(*(self._one(line) for line in lines)))

    async def _one(self, line: Line) -> tuple[str, bool, dict, int]:
        """As a Serve replica runs a batch line (server/batch_lines.py): vLLM's serving objects in this process, or
        vLLM's HTTP app where they do not answer with a 200."""
        from deployments.server.batch_lines import answer_line

        request_id = f"batch-{uuid.uuid4().hex}"
        app = self._engine_app.app
        status, body = await answer_line(app, app, {"url": line.url, "body": line.body, "request_id": request_id})
        ok = 200 <= status < 300
        tokens = (body.get("usage") or {}).get("completion_tokens", 0) if ok and isinstance(body, dict) else 0
        return line.custom_id, ok, result_line(line, status, body, request_id), tokens


def actors_for(model: ModelConfig) -> int:
    d = model.deployment
    if d.autoscaling_config:
        return int(d.autoscaling_config.get("max_replicas", d.autoscaling_config.get("min_replicas", 1)) or 1)
    return max(1, d.num_replicas)


def run_ray_data(todo: list[Line], config: SummitConfig, out: Path, err: Path, progress: bool) -> dict[str, Any]:
    import ray.data

    from app.build.options import replica_num_cpus

    # start every engine actor before work is handed out: an engine takes seconds to minutes to load, and the first
    # one ready would otherwise take every block of a short job
    ray.data.DataContext.get_current().wait_for_min_actors_s = ENGINE_START_TIMEOUT_S
    counts: dict[str, Any] = {"ran": 0, "completed": 0, "failed": 0, "output_tokens": 0, "workers": {}}
    bar = Progress(len(todo), 0, progress)
    first, last = float("inf"), 0.0  # when the engines worked on lines (not loading)
    with open(out, "ab") as out_f, open(err, "ab") as err_f:
        for model in config.models:
            lines = [line for line in todo if line.model == model.name]
            if not lines:
                continue
            if model.tensor_parallel_size * model.pipeline_parallel_size > 1:
                raise ValueError(
                    f"models[{model.name}]: --ray-data runs one engine per GPU; tensor_parallel_size "
                    "and pipeline_parallel_size must be 1 there (run without --ray-data: Serve places "
                    "TP x PP)"
                )
            rows = [
                {"number": x.number, "custom_id": x.custom_id, "url": x.url, "body": json.dumps(x.body)}
                for x in grouped(lines)
            ]
            engine = model.model_copy(update={"disaggregation": None})
            actors = actors_for(model)
            # blocks small enough that every actor gets several (a block larger than the job would go to one)
            batch_size = max(1, min(BATCH_SIZE, -(-len(rows) // (4 * actors))))
            ds = ray.data.from_items(rows).map_batches(
                EngineWorker,
                batch_size=batch_size,
                fn_constructor_kwargs={"model_json": engine.model_dump_json(), "source": model.resolved_source()},
                concurrency=actors,
                num_cpus=replica_num_cpus(model),
                num_gpus=1 if model.accelerator == "gpu" else 0,
                batch_format="numpy",
            )
            for block in ds.iter_batches(batch_size=None, batch_format="numpy"):
                first, last = min(first, float(block["started"].min())), max(last, float(block["ended"].max()))
                for cid, ok, result, tokens, worker in zip(
                    block["custom_id"], block["ok"], block["result"], block["tokens"], block["worker"]
                ):
                    (out_f if ok else err_f).write(str(result).encode() + b"\n")
                    counts["ran"] += 1
                    counts["completed" if ok else "failed"] += 1
                    counts["output_tokens"] += int(tokens)
                    counts["workers"][str(worker)] = counts["workers"].get(str(worker), 0) + 1
                    bar.update(int(tokens))
                out_f.flush()
                err_f.flush()
        for f in (out_f, err_f):
            os.fsync(f.fileno())
    bar.close()
    seconds = max(0.0, last - first)
    return {**counts, "seconds": round(seconds, 2), "tok_per_s": round(counts["output_tokens"] / max(seconds, 1e-9), 1)}
