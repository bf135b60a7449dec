"""The arguments of `summit sbatch`: the CLI's subcommand, and the parser a written script's header is re-read with
(app/clusters/sbatch.py). Light on purpose: the CLI builds its parser from here without loading the planner."""

from __future__ import annotations

import argparse


def sbatch_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `summit sbatch` (the CLI's subcommand, and the header a script is re-read from)."""
    p.add_argument("file", help="the Serve YAML the job deploys (its path as the job will see it)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs of one node (0: CPU engines)")
    p.add_argument("--nodes", type=int, default=None, help="default: the fewest that hold the YAML's replicas")
    p.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's default)")
    p.add_argument("--time", default="24:00:00", help="the job's time limit (it drains 5 minutes before)")
    p.add_argument("--gpu", default="h100-80gb", help="GPU model for the memory check (summit validate's --gpu)")
    p.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPUs a node (default: 8 per GPU asked for, at most 32; 4 for CPU engines)",
    )
    p.add_argument("--mem", default=None, help="memory a node, as sbatch takes it (e.g. 64G; default: the site's)")
    p.add_argument(
        "--exclusive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask for whole nodes (default: only for a job of more than one node)",
    )
    p.add_argument(
        "--batch",
        default=None,
        metavar="INPUT",
        help="an offline batch job instead of a server: run this JSONL file (summit batch) on the allocation, then end",
    )
    p.add_argument(
        "--batch-output", default=None, metavar="OUTPUT", help="the batch's answered lines (default: INPUT.out.jsonl)"
    )
    p.add_argument(
        "--concurrency", type=int, default=512, help="--batch: lines in flight (the Batch API's max_concurrency)"
    )
    p.add_argument("--gpu-type", default=None, help="the GPUs' type as the site's gres names it: --gres=gpu:TYPE:N")
    p.add_argument("--constraint", default=None, help="node features the job needs (sbatch --constraint)")
    p.add_argument("-o", "--output", default=None, help="write the script here (default: print it)")


def sbatch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="summit sbatch")
    sbatch_arguments(p)
    return p
