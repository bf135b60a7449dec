"""`summit sbatch`: an sbatch script for a Serve YAML, sized by the planner (pure, except reading the YAML).

The script is a header (the #SBATCH lines for this YAML and the command that wrote it) and one fixed body
(`app/clusters/slurm_job.sh`): the Ray head on the first node, a worker per other node, token auth, this job's own
ports, `serve deploy`, readiness in `endpoint.json`, a drain before the time limit, lost nodes reported.
`cluster_yaml/slurm/summit.sbatch` is this command's output for serve_configs/llama405b.yaml (a unit test
regenerates it from the command in its header).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from app.clusters.sbatch_args import sbatch_parser
from app.plan.validate import Hardware, validate_doc

BODY = Path(__file__).with_name("slurm_job.sh")
DRAIN_S = 300  # SLURM signals the job this long before its time limit


@dataclass(frozen=True)
class JobSpec:
    config: str
    gpus_per_node: int
    nodes: int | None = None
    partition: str | None = None
    time: str = "24:00:00"
    gpu: str = "h100-80gb"
    cpus_per_task: int | None = None  # default: cpus()
    mem: str | None = None
    exclusive: bool | None = None  # default: whole nodes for a job of more than one node
    batch: str | None = None  # an offline batch job over this JSONL file instead of a server
    batch_output: str | None = None
    job_name: str = "summit"
    gpu_type: str | None = None  # the GPUs' type in SLURM's gres (`--gres=gpu:TYPE:N`)
    constraint: str | None = None  # node features (`--constraint`)
    batch_concurrency: int = 512  # batch lines in flight (the Batch API's max_concurrency)

    @classmethod
    def from_args(cls, ns) -> JobSpec:
        """From `summit sbatch`'s parsed arguments (app/clusters/sbatch_args.py)."""
        return cls(
            ns.file,
            ns.gpus_per_node,
            ns.nodes,
            ns.partition,
            ns.time,
            ns.gpu,
            ns.cpus_per_task,
            ns.mem,
            ns.exclusive,
            ns.batch,
            ns.batch_output,
            job_name="summit-batch" if ns.batch else "summit",
            gpu_type=ns.gpu_type,
            constraint=ns.constraint,
            batch_concurrency=ns.concurrency,
        )

    def cpus(self) -> int:
        """CPUs a node: the given count, else 8 per GPU asked for (at most 32), 4 for CPU engines."""
        if self.cpus_per_task is not None:
            return self.cpus_per_task
        return min(32, 8 * self.gpus_per_node) if self.gpus_per_node > 0 else 4

    def output(self) -> str | None:
        if self.batch is None:
            return None
        return self.batch_output or str(Path(self.batch).with_suffix("")) + ".out.jsonl"

    def command(self) -> str:
        parts = ["summit", "sbatch", self.config, "--gpus-per-node", str(self.gpus_per_node)]
        if self.nodes is not None:
            parts += ["--nodes", str(self.nodes)]
        if self.partition:
            parts += ["--partition", self.partition]
        parts += ["--time", self.time, "--gpu", self.gpu]
        if self.cpus_per_task is not None:
            parts += ["--cpus-per-task", str(self.cpus_per_task)]
        if self.mem:
            parts += ["--mem", self.mem]
        if self.exclusive is not None:
            parts.append("--exclusive" if self.exclusive else "--no-exclusive")
        for flag, value in (("--gpu-type", self.gpu_type), ("--constraint", self.constraint)):
            if value:
                parts += [flag, value]
        if self.batch is not None:
            parts += ["--batch", self.batch]
            if self.batch_output:
                parts += ["--batch-output", self.batch_output]
            if self.batch_concurrency != 512:
                parts += ["--concurrency", str(self.batch_concurrency)]
        return " ".join(shlex.quote(p) for p in parts)


def size_nodes(doc: dict, spec: JobSpec, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Nodes the YAML's replicas need at `gpus_per_node` (the fewest that pass `summit validate`), or the given
    count checked; raises ValueError with validate's problems when it cannot fit."""
    if spec.gpus_per_node <= 0:  # CPU engines: nothing to size, one node unless told
        return spec.nodes or 1, []
    first = validate_doc(doc, Hardware(spec.gpu, spec.gpus_per_node, spec.nodes or 1), env)
    if spec.nodes is not None:
        if not first.ok:
            raise ValueError("; ".join(first.problems))
        return spec.nodes, first.lines
    used = _gpus_used(first.lines)
    start = max(1, math.ceil(used / spec.gpus_per_node)) if used else 1
    for nodes in range(start, start + 64):
        report = validate_doc(doc, Hardware(spec.gpu, spec.gpus_per_node, nodes), env)
        if report.ok:
            return nodes, report.lines
    raise ValueError("; ".join(first.problems))


def _gpus_used(lines: list[str]) -> int:
    """From validate's last line, `GPUs: USED of HAVE (...)`."""
    for line in reversed(lines):
        if line.startswith("GPUs: "):
            return int(line.split()[1])
    return 0


def render(spec: JobSpec, env: dict[str, str] | None = None, doc: dict | None = None) -> str:
    doc = doc if doc is not None else yaml.safe_load(Path(spec.config).read_text())
    nodes, lines = size_nodes(doc, spec, env)
    sbatch = [f"--job-name={spec.job_name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    if spec.gpus_per_node > 0 and spec.gpu_type:
        sbatch.append(f"--gres=gpu:{spec.gpu_type}:{spec.gpus_per_node}")
    elif spec.gpus_per_node > 0:
        sbatch.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.constraint:
        sbatch.append(f"--constraint={spec.constraint}")
    sbatch.append(f"--cpus-per-task={spec.cpus()}")
    if spec.mem:
        sbatch.append(f"--mem={spec.mem}")
    if spec.exclusive if spec.exclusive is not None else nodes > 1:
        sbatch.append("--exclusive")
    sbatch.append(f"--time={spec.time}")
    if spec.partition:
        sbatch.append(f"--partition={spec.partition}")
    if spec.batch is None:
        sbatch.append(f"--signal=B:USR1@{DRAIN_S}")
    sbatch.append("--output=summit-%j.out")
    sizing = "\n".join(f"#   {line}" for line in lines) or "#   (CPU engines: not sized for GPUs)"
    what = (
        f"`serve deploy` of {spec.config}"
        if spec.batch is None
        else f"`summit batch` of {spec.batch} on the models of {spec.config}, answers in {spec.output()}"
    )
    header = f"""#!/usr/bin/env bash
# Summit on a SLURM allocation: the Ray head on the first node, a Ray worker on every other node (srun +
# `ray start --block`), Ray token auth, then {what}. Written by:
#   {spec.command()}
# Sizing (summit validate, {spec.gpu}):
{sizing}
#
#   sbatch summit.sbatch [--config FILE] [--log-dir DIR] [--venv DIR]   (sbatch options override the #SBATCH lines)
#   DRY_RUN=1 bash summit.sbatch --dry-run                              # print the commands, run nothing
#
"""
    header += _what_the_job_does(spec)
    header += "".join(f"#SBATCH {line}\n" for line in sbatch)
    header += f"""
SERVE_CONFIG=${{SERVE_CONFIG:-{spec.config}}}
GPUS_PER_NODE_DEFAULT={spec.gpus_per_node}
"""
    if spec.batch is not None:
        header += f"""BATCH_INPUT=${{BATCH_INPUT:-{spec.batch}}}
BATCH_OUTPUT=${{BATCH_OUTPUT:-{spec.output()}}}
BATCH_CONCURRENCY=${{BATCH_CONCURRENCY:-{spec.batch_concurrency}}}
"""
    return header + BODY.read_text()


def idle_gpus(spec: JobSpec, env: dict[str, str] | None = None, doc: dict | None = None) -> str | None:
    """A warning when the job asks for more GPUs than the YAML's replicas use (they would sit idle all job long)."""
    doc = doc if doc is not None else yaml.safe_load(Path(spec.config).read_text())
    if spec.gpus_per_node <= 0:
        return None
    nodes, lines = size_nodes(doc, spec, env)
    used, asked = _gpus_used(lines), nodes * spec.gpus_per_node
    if used >= asked:
        return None
    return (
        f"the job asks for {asked} GPUs ({nodes} × --gpus-per-node {spec.gpus_per_node}) but the YAML's replicas use "
        f"{used}: {asked - used} would sit idle. Ask for --gpus-per-node {used // nodes if used % nodes == 0 else used}"
        ", or add replicas (deployment.num_replicas) or a wider tensor_parallel_size"
    )


def _what_the_job_does(spec: JobSpec) -> str:
    """The header's paragraph on what the job does after Ray is up (a server, or a batch), and its logs."""
    header = ""
    if spec.batch is None:
        header += f"""\
# Each job picks free ports for Ray, the dashboard and Serve's HTTP (bound to 127.0.0.1 on the head node) and keeps
# its sockets under /tmp/summit-<job id>, so two jobs can share a node. When the app answers, LOG_DIR/endpoint.json
# (default ./logs/summit-<job id>/) says `"state": "ready"` with its `url`, `host`, `port` and the `tunnel` to reach
# it from a login node: `ssh -N -L PORT:127.0.0.1:PORT <head node>`, then OPENAI_BASE_URL=http://127.0.0.1:PORT/v1.
# SLURM signals the job {DRAIN_S} s before its time limit: it drains (no new requests, running streams finish) and
# ends. A node that leaves is reported in the log and endpoint.json. `scancel` stops every process the job started.
"""
    else:
        header += """\
# The batch runs once every node's Ray has joined (no HTTP server); LOG_DIR/endpoint.json says `running`, then
# `finished` or `failed` with the line counts. Lines already answered in the output are skipped: submit the same script
# again after a time-out or a failure and it goes on where it stopped.
"""
    header += """\
# When the job ends (time limit, scancel, failure) each node's Ray logs (replicas, engines, controller, HAProxy)
# are copied to LOG_DIR/ray-logs/<node>/ before the node-local state is removed.
# Token auth: RAY_AUTH_MODE=token for every Ray process; the token is RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token
# on the shared home directory), generated when missing. Batch API: put `batch.files_path` on the shared filesystem
# and `batch.db_path` on the head node's local disk (docs/features/batch.md). Environment overrides: SERVE_CONFIG,
# LOG_DIR, STATE_DIR, SUMMIT_VENV, GPUS_PER_NODE, CPUS_PER_NODE, NODES_WAIT_S, READY_WAIT_S, SUMMIT_NODES (outside
# SLURM).
"""
    return header


def spec_from_header(text: str) -> JobSpec:
    """The JobSpec whose command wrote this script (its third line)."""
    line = next(ln for ln in text.splitlines() if ln.startswith("#   summit sbatch "))
    args = shlex.split(line[4:])[2:]
    return JobSpec.from_args(sbatch_parser().parse_args(args))
