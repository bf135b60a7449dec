"""`summit` command line."""

from __future__ import annotations

import argparse
import sys

from app.clusters.sbatch_args import sbatch_arguments

DEFAULT_TINY_MODEL = "~/.cache/summit/models/tiny-llama"
DISTRIBUTION = "summit-serve"  # pip's name for Summit (`summit` on PyPI is another project)


def _make_tiny_model(ns: argparse.Namespace) -> int:
    from app.clusters.tiny_model import make_tiny_model

    print(make_tiny_model(ns.dir, seed=ns.seed, hidden_size=ns.hidden_size, arch=ns.arch))
    return 0


def _make_tiny_lora(ns: argparse.Namespace) -> int:
    from app.clusters.tiny_model import make_tiny_lora

    print(make_tiny_lora(ns.base, ns.dir, seed=ns.seed, rank=ns.rank))
    return 0


def _make_model_config(ns: argparse.Namespace) -> int:
    from app.clusters.tiny_model import make_model_config

    print(make_model_config(ns.preset, ns.dir, fp8=ns.fp8, layers=ns.layers))
    return 0


def _wait_ready(ns: argparse.Namespace) -> int:
    from app.clusters.ready import app_names, base_url, dashboard_address, wait_and_say, write_report
    from app.clusters.serve_status import Dashboard

    board = Dashboard(dashboard_address(ns.address))
    outcome = wait_and_say(
        base_url(ns.config), ns.timeout, while_pid=ns.while_pid, dashboard=lambda: board, names=app_names(ns.config)
    )
    if ns.report:
        write_report(ns.report, outcome)
    return 0 if outcome.state == "ready" else 1


def _serve_local(ns: argparse.Namespace) -> int:
    from app.clusters.local_serve import serve_local

    return serve_local(ns.config, ns.timeout)


def _plan(ns: argparse.Namespace) -> int:
    from app.plan import planner
    from app.plan.checkpoint import load_shape_of
    from app.plan.plan_text import format_plan

    try:
        shape = load_shape_of(ns.model)
        budget = planner.Budget(ns.gpu, ns.gpu_memory_utilization, ns.max_num_batched_tokens, ns.max_num_seqs)
        tokens = planner.parse_tokens(ns.context)
        ns.dtype = ns.dtype or shape.checkpoint_dtype or "bf16"  # an FP8 checkpoint's preset sizes fp8 weights
        if ns.throughput:
            from app.plan import throughput

            work = throughput.Workload(ns.concurrency, ns.prompt_tokens, ns.output_tokens, ns.prefix_hit)
            gpus = ns.gpus or ns.gpus_per_node
            options = throughput.compare_layouts(
                shape, ns.gpu, gpus, work, ns.dtype, ns.kv_dtype, ns.gpus_per_node, budget
            )
            print(throughput.format_comparison(shape, ns.gpu, gpus, work, options))
            return 0 if options else 1
        print(format_plan(planner.plan(shape, ns.gpu, tokens, ns.dtype, ns.kv_dtype, ns.gpus_per_node, budget)))
    except (KeyError, ValueError) as e:
        print(f"summit plan: error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    return 0


def _simulate(ns: argparse.Namespace) -> int:
    from app.simulate.run import cli_main

    return cli_main(ns)


def _validate(ns: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from app.plan.validate import Hardware, validate_file

    try:
        report = validate_file(ns.file, Hardware(ns.gpu, ns.gpus_per_node, ns.nodes))
    except (ValidationError, ValueError, OSError) as e:
        print(f"summit validate: {ns.file}: {e}", file=sys.stderr)
        return 1
    for line in report.lines + [f"note: {note}" for note in report.notes]:
        print(line)
    for problem in report.problems:
        print(f"error: {problem}", file=sys.stderr)
    print(f"{ns.file}: {'ok' if report.ok else 'does not fit'}", file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


def _batch(ns: argparse.Namespace) -> int:
    import json

    from app.batch.offline import run

    try:
        summary = run(
            ns.input,
            ns.output,
            ns.config,
            err_path=ns.errors,
            address=ns.address,
            concurrency=ns.concurrency,
            app_name=ns.app,
            progress=not ns.no_progress,
            ray_data=ns.ray_data,
            num_cpus=ns.num_cpus,
            retry=ns.retry_errors,
        )
    except (ValueError, OSError) as e:
        print(f"summit batch: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0 if summary["ran"] + summary["skipped"] == summary["lines"] else 1


def _kuberay(ns: argparse.Namespace) -> int:
    from app.clusters.kuberay import render_rayservice

    sys.stdout.write(
        render_rayservice(
            ns.file, name=ns.name, image=ns.image, gpus_per_node=ns.gpus_per_node, models_pvc=ns.models_pvc
        )
    )
    return 0


def _add_throughput_options(p) -> None:
    """`summit plan --throughput` and the workload it is estimated for."""
    p.add_argument(
        "--throughput",
        action="store_true",
        help="compare replicas × TP layouts of --gpus GPUs by estimated tokens/s (a roofline)",
    )
    p.add_argument("--gpus", type=int, help="--throughput: GPUs to divide (default: --gpus-per-node)")
    p.add_argument("--concurrency", type=int, default=256, help="--throughput: streams in flight, all replicas")
    p.add_argument("--prompt-tokens", type=int, default=128, help="--throughput: prompt length")
    p.add_argument("--output-tokens", type=int, default=256, help="--throughput: tokens generated per request")
    p.add_argument(
        "--prefix-hit",
        type=float,
        default=0.0,
        help="--throughput: share of prompt tokens already in the prefix cache (shared system prompts, chat turns)",
    )


def _add_sizing_commands(sub) -> None:
    from app.plan.planner import GPUS_MIB, KV_BYTES, WEIGHT_BYTES

    p = sub.add_parser("plan", help="weights + KV cache → GPUs, suggested TP / PP / nodes")
    p.add_argument(
        "--model", required=True, help="preset (llama-3.1-8b|70b|405b, or 8b|70b|405b) or path to config.json"
    )
    p.add_argument("--gpu", required=True, choices=sorted(GPUS_MIB), help="the GPU model (its memory)")
    p.add_argument("--context", default="131072", help="tokens of one sequence: 131072, 128k (=128,000) or 128Ki")
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(WEIGHT_BYTES),
        help="weights (default: what the checkpoint's quantization_config stores, else bf16)",
    )
    p.add_argument("--kv-dtype", default="bf16", choices=list(KV_BYTES), help="KV cache")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of one node (TP stays inside a node)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of each GPU's memory vLLM may use")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill chunk (activation headroom)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="batch size (sampler headroom)")
    _add_throughput_options(p)
    p.set_defaults(func=_plan)

    p = sub.add_parser("validate", help="refuse a Serve YAML whose models cannot fit the given GPUs and nodes")
    p.add_argument("file", help="the Serve YAML to check")
    p.add_argument("--gpu", required=True, choices=sorted(GPUS_MIB), help="the GPU model of every node")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of one node")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the cluster")
    p.set_defaults(func=_validate)

    p = sub.add_parser("simulate", help="a Serve YAML's model under a load, simulated from a measured engine profile")
    p.add_argument("file", help="the Serve YAML")
    p.add_argument("--load", required=True, help="the traffic (a YAML: docs/configuration/simulate.md)")
    p.add_argument("--profile", required=True, help="the engine's measured step times (bench/results/profile-*.json)")
    p.add_argument("--model", default=None, help="which of the YAML's models (default: the first)")
    p.add_argument("--gpu", default=None, choices=sorted(GPUS_MIB), help="size a GPU model's KV cache for this GPU")
    p.add_argument("--policy", default=None, help="routing policy instead of the YAML's")
    p.add_argument("--replicas", type=int, default=None, help="a fixed replica count instead of the YAML's")
    p.add_argument("--seed", type=int, default=0, help="the routers' random choices (the load has its own `seed`)")
    p.add_argument("--json", default=None, help="also write the figures and the replicas' timeline here")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("kuberay", help="print a KubeRay RayService whose serveConfigV2 is FILE (a Serve YAML)")
    p.add_argument("file", help="the Serve YAML (becomes serveConfigV2)")
    p.add_argument("--name", default=None, help="RayService name (default: summit-<file stem>)")
    p.add_argument("--image", default="summit:0.1.0-gpu", help="Ray 2.60 GPU image with Summit installed")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of one worker pod")
    p.add_argument("--models-pvc", default="summit-models", help="PersistentVolumeClaim mounted at /models")
    p.set_defaults(func=_kuberay)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="summit", description="Serve large open LLMs with vLLM on Ray Serve.")
    parser.add_argument("--version", action="version", version=f"summit {version()} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_model_commands(sub)
    _add_cluster_commands(sub)
    _add_batch_command(sub)
    _add_sizing_commands(sub)
    sub.metavar = "{" + ",".join(a.dest for a in sub._choices_actions) + "}"  # the listed ones (not job-env)
    for p in sub.choices.values():
        p.formatter_class = _HelpWithDefaults
    return parser


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, where it has one to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default in (None, False) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_model_commands(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="write the tiny random-weight Llama (real tokenizer) to DIR")
    p.add_argument("dir", nargs="?", default=DEFAULT_TINY_MODEL, help="where to write it")
    p.add_argument("--seed", type=int, default=0, help="another seed, other weights")
    p.add_argument("--hidden-size", type=int, default=128, help="256 for GPUs (head_dim 64 for FlashAttention)")
    p.add_argument(
        "--arch",
        default="llama",
        choices=["llama", "mistral", "qwen2", "mixtral"],
        help="the model family's config and weight names (mixtral: 4 experts, 2 a token)",
    )
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("make-tiny-lora", help="write a random LoRA adapter (PEFT format) for the tiny model to DIR")
    p.add_argument("dir", help="where to write it")
    p.add_argument("--base", default=DEFAULT_TINY_MODEL, help="the tiny model's directory (its shapes)")
    p.add_argument("--seed", type=int, default=1, help="another seed, another adapter")
    p.add_argument("--rank", type=int, default=8, help="the LoRA rank")
    p.set_defaults(func=_make_tiny_lora)

    p = sub.add_parser("make-model-config", help="write a real-shape config.json + tokenizer (for load_format: dummy)")
    p.add_argument("preset", help="llama-3.1-8b | llama-3.1-70b | llama-3.1-405b (or 8b, 70b, 405b)")
    p.add_argument("dir", help="where to write config.json and the tokenizer")
    p.add_argument(
        "--fp8",
        nargs="?",
        const="fp8",
        choices=["fp8", "fbgemm"],
        help="declare FP8 weights (an FP8 checkpoint's quantization_config: vLLM allocates them in FP8): fp8 = every "
        "linear layer; fbgemm = Meta's own FP8 checkpoints, exactly (the llama-3.1-405b-fp8 preset's default)",
    )
    p.add_argument("--layers", type=int, default=None, help="fewer layers at full width (a depth-reduced model)")
    p.set_defaults(func=_make_model_config)


def _add_cluster_commands(sub) -> None:
    p = sub.add_parser("wait-ready", help="wait until CONFIG's application answers on its HTTP port, then say so")
    p.add_argument("config", help="the Serve YAML being served (its http_options give the address)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds")
    p.add_argument("--while-pid", type=int, default=None, help="give up when this process (e.g. `serve run`) exits")
    p.add_argument(
        "--address",
        default=None,
        help="the Ray dashboard `serve deploy` used, whose Serve status says why a start failed (default: "
        "RAY_DASHBOARD_ADDRESS, else http://127.0.0.1:8265)",
    )
    p.add_argument("--report", default=None, help="also write how the wait ended here (JSON: state, reason, fix, log)")
    p.set_defaults(func=_wait_ready)

    p = sub.add_parser(
        "serve-local",
        help="serve a Serve YAML on a private Ray instance of this machine until Ctrl-C (README command 1): say when "
        "it answers; Ctrl-C stops it at once when no request is in flight, after a graceful drain otherwise",
    )
    p.add_argument("config", help='the Serve YAML (run `eval "$(summit direct-path-env)"` first for the direct path)')
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the ready line")
    p.set_defaults(func=_serve_local)

    p = sub.add_parser(
        "direct-path-env",
        help="print `export` lines putting a Ray started from this shell on the "
        "direct path (Serve's HAProxy with loopback stats, body-aware route picker)",
    )
    p.set_defaults(func=_direct_path_env)

    p = sub.add_parser("sbatch", help="write an sbatch script for a Serve YAML, sized by the planner")
    sbatch_arguments(p)
    p.set_defaults(func=_sbatch)

    p = sub.add_parser(  # no help=: the SLURM job script's, not a user's (kept out of `summit --help`)
        "job-env",
        description="print `export` lines giving one job (SLURM) its own Ray / Serve / HAProxy "
        "ports and files, and write its Serve YAML with that HTTP port",
    )
    p.add_argument("--state-dir", required=True, help="a short directory of the job's own (HAProxy's sockets)")
    p.add_argument("--config", required=True, help="the Serve YAML the job deploys")
    p.add_argument("--config-out", required=True, help="where to write the job's copy of it")
    p.set_defaults(func=_job_env)


def _add_batch_command(sub) -> None:
    p = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) offline on the models of a Serve YAML")
    p.add_argument("input", help="JSONL lines {custom_id, method, url, body}, as for the Batch API")
    p.add_argument("-o", "--output", required=True, help="answered lines (appended; a rerun skips them)")
    p.add_argument(
        "-e", "--errors", default=None, help="lines answered with an error (default: OUTPUT's name with .errors.jsonl)"
    )
    p.add_argument("--config", required=True, help="the Serve YAML whose models run the lines")
    p.add_argument("--app", default=None, help="which application of the YAML (default: its one Summit app)")
    p.add_argument("--address", default=None, help="a running Ray cluster (default: start a private local one)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the private local Ray (default: all)")
    p.add_argument("--concurrency", type=int, default=512, help="lines in flight (the Batch API's max_concurrency)")
    p.add_argument(
        "--retry-errors",
        choices=["transient", "all", "none"],
        default="transient",
        help="lines of the errors file a rerun runs again: transient (5xx, 408, 429, no answer; a 4xx is the request's "
        "own fault), all, or none",
    )
    p.add_argument(
        "--ray-data",
        action="store_true",
        help="Ray Data: map_batches over one engine actor per "
        "replica of the model (its deployment.num_replicas), for jobs larger than one replica",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=_batch)


def _sbatch(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from app.clusters.sbatch import JobSpec, idle_gpus, render

    spec = JobSpec.from_args(ns)
    try:
        script, idle = render(spec), idle_gpus(spec)
    except (ValueError, OSError) as e:
        print(f"summit sbatch: error: {e}", file=sys.stderr)
        return 2
    if idle:
        print(f"summit sbatch: warning: {idle}", file=sys.stderr)
    if ns.output:
        Path(ns.output).write_text(script)
        Path(ns.output).chmod(0o755)
        # its paths (the YAML, the venv, logs) are relative to this directory, where the job must start
        here, written = Path.cwd(), Path(ns.output).resolve()
        print(f"summit sbatch: wrote {ns.output}; submit it with: cd {here} && sbatch {written}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def _job_env(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from app.clusters.job_env import exports, job_exports

    print(exports(job_exports(Path(ns.state_dir), Path(ns.config), Path(ns.config_out))))
    return 0


def _direct_path_env(ns: argparse.Namespace) -> int:
    from app.clusters.job_env import direct_path_exports, exports

    print(exports(direct_path_exports()))
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
