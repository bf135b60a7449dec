"""Placement of one engine replica: TP × PP → Ray placement-group bundles and strategy (pure, no Ray import).

A replica whose TP x PP workers fit one node runs vLLM's `mp` executor: the plan is one bundle holding every GPU
and the workers' CPUs, and the replica actor itself takes it (Ray then sets the actor's CUDA_VISIBLE_DEVICES to exactly
those GPUs, which the engine's worker processes inherit). A replica that spans nodes runs vLLM's Ray executor, which
starts one worker per bundle that holds a GPU, so the plan has exactly one bundle `{"GPU": 1, "CPU": 1}` per worker,
ordered stage by stage (bundles `s*tp .. s*tp+tp-1` are pipeline stage `s`, one tensor-parallel group). Ray Serve
starts the replica actor itself in bundle 0, so the actor's own resources are merged into bundle 0 (the actor then
asks for nothing outside the group).

Strategy: STRICT_PACK (one node) when the replica fits one node; otherwise PACK, which keeps each TP group
inside one node only when TP groups tile the nodes exactly (`gpus_per_node % tensor_parallel_size == 0`);
pipeline stages may span nodes. PACK is best effort: `split_tp_groups` checks where bundles really landed.

On CPU (`accelerator: cpu`) vLLM runs the `mp` executor (its CPU platform refuses Ray's: "current platform cpu
does not support ray"), so a CPU replica is one bundle holding the actor's CPUs; its engine processes run beside it
on that node. (CI runs the GPU plan on CPU-only nodes through a vLLM platform plugin:
see deployments/engine/platform.py.)

`unplaceable` says why a plan can never be placed on a cluster's nodes (the builder refuses such a deploy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from app.config.model import DEFAULT_GPUS_PER_NODE

Strategy = Literal["STRICT_PACK", "PACK"]
WORKER_CPUS = 1.0  # CPU reserved next to each GPU worker (tokenization, NCCL progress, Python)


@dataclass(frozen=True)
class PlacementPlan:
    """The placement group one replica needs, and where the plan expects each bundle to land."""

    bundles: tuple[dict[str, float], ...]
    strategy: Strategy
    expected_nodes: tuple[int, ...]  # node index (0-based, in PACK order) of bundle i
    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpus_per_node: int

    @property
    def num_gpus(self) -> int:
        return int(sum(b.get("GPU", 0) for b in self.bundles))

    @property
    def num_nodes(self) -> int:
        return max(self.expected_nodes) + 1

    @property
    def node_parts(self) -> list[int]:
        """The GPUs of the replica that must share a node: one part per node the plan expects (every GPU under
        STRICT_PACK; whole TP groups under PACK, which `split_tp_groups` holds the replica to)."""
        per_node: dict[int, float] = {}
        for bundle, node in zip(self.bundles, self.expected_nodes):
            per_node[node] = per_node.get(node, 0) + bundle.get("GPU", 0)
        return [int(gpus) for gpus in per_node.values() if gpus]

    def tp_group(self, stage: int) -> range:
        """Bundle indices of pipeline stage `stage` (one tensor-parallel group)."""
        tp = self.tensor_parallel_size
        return range(stage * tp, stage * tp + tp)


def _check_sizes(tensor_parallel_size: int, pipeline_parallel_size: int, gpus_per_node: int, num_cpus: float) -> None:
    for key, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("gpus_per_node", gpus_per_node),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a whole number ≥ 1 (e.g. `{key}: 1`)")
    if num_cpus < 0:
        raise ValueError(f"deployment.num_cpus={num_cpus!r}: must be ≥ 0")


def _check_tp_inside_node(tp: int, gpus_per_node: int, allow_cross_node_tp: bool) -> None:
    """Refuse a multi-node layout in which some tensor-parallel group would straddle two nodes."""
    if allow_cross_node_tp:
        return
    if tp > gpus_per_node:
        raise ValueError(
            f"tensor_parallel_size={tp} is larger than gpus_per_node={gpus_per_node}: one TP group would span nodes "
            f"(all-reduce every layer over the network). Fix: set tensor_parallel_size to {gpus_per_node} or less and "
            f"raise pipeline_parallel_size (PP stages may span nodes), or set `allow_cross_node_tp: true` to accept it."
        )
    if gpus_per_node % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide gpus_per_node={gpus_per_node}: TP groups packed node by node "
            f"would split one group across two nodes. Fix: use a tensor_parallel_size that divides {gpus_per_node} "
            f"(e.g. {_largest_divisor_at_most(gpus_per_node, tp)}), or set `allow_cross_node_tp: true` to accept it."
        )


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def plan_placement(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    accelerator: Literal["cpu", "gpu"] = "gpu",
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    allow_cross_node_tp: bool = False,
    num_cpus: float = 1.0,
    executor: Literal["mp", "ray"] | None = None,
) -> PlacementPlan:
    """Placement of one replica; `num_cpus` are the replica actor's own CPUs (merged into bundle 0); `executor` is
    vLLM's for several GPU workers (ModelConfig.distributed_executor): `mp` plans one bundle for the actor."""
    _check_sizes(tensor_parallel_size, pipeline_parallel_size, gpus_per_node, num_cpus)
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if accelerator == "cpu":
        if num_cpus <= 0:
            raise ValueError(
                "deployment.num_cpus must be > 0 on CPU: the replica's one bundle holds its CPUs "
                "(Ray refuses an empty bundle). Fix: e.g. `num_cpus: 0.5`."
            )
        return PlacementPlan(({"CPU": float(num_cpus)},), "STRICT_PACK", (0,), tp, pp, gpus_per_node)
    if accelerator != "gpu":
        raise ValueError(f"accelerator={accelerator!r}: must be `cpu` or `gpu`")
    workers = tp * pp
    if executor == "mp" and workers > 1:
        if workers > gpus_per_node:
            raise ValueError(
                f"the mp executor runs every worker on one node: {workers} GPUs do not fit "
                f"gpus_per_node={gpus_per_node}"
            )
        bundle = {"GPU": float(workers), "CPU": WORKER_CPUS * workers + float(num_cpus)}
        return PlacementPlan((bundle,), "STRICT_PACK", (0,), tp, pp, gpus_per_node)
    bundles = [{"GPU": 1.0, "CPU": WORKER_CPUS} for _ in range(workers)]
    bundles[0] = {"GPU": 1.0, "CPU": WORKER_CPUS + float(num_cpus)}
    if workers <= gpus_per_node:
        return PlacementPlan(tuple(bundles), "STRICT_PACK", (0,) * workers, tp, pp, gpus_per_node)
    _check_tp_inside_node(tp, gpus_per_node, allow_cross_node_tp)
    nodes = tuple(i // gpus_per_node for i in range(workers))
    return PlacementPlan(tuple(bundles), "PACK", nodes, tp, pp, gpus_per_node)


def placement_deployment_options(plan: PlacementPlan) -> dict:
    """The Ray Serve deployment options for the plan (the replica actor itself then asks for no GPU)."""
    return {
        "placement_group_bundles": [dict(b) for b in plan.bundles],
        "placement_group_strategy": plan.strategy,
    }


def split_tp_groups(plan: PlacementPlan, bundle_nodes: list[str]) -> list[int]:
    """Pipeline stages whose TP group landed on more than one node, given each bundle's actual node id.

    PACK does not promise the expected layout when nodes are partly busy; a replica can check this once its
    placement group is ready and refuse to start a TP group that crosses nodes.
    """
    if len(bundle_nodes) != len(plan.bundles):
        raise ValueError(f"got {len(bundle_nodes)} bundle nodes for a plan of {len(plan.bundles)} bundles")
    if len(plan.bundles) == 1:  # a CPU replica, or every worker in the replica's own bundle (mp)
        return []
    return [s for s in range(plan.pipeline_parallel_size) if len({bundle_nodes[i] for i in plan.tp_group(s)}) > 1]


def unplaceable(
    bundles: Sequence[Mapping[str, float]], strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why a placement group of `bundles` can never be placed on nodes with these total resources, or None if it can.

    Only the resources the bundles ask for are compared (Ray's node totals also list memory, node ids, ...).
    STRICT_PACK needs one node holding every bundle; PACK places bundles first-fit (largest first) over the
    nodes. The answer names the missing resource: a node size or a cluster total.
    """
    keys = sorted({k for b in bundles for k, v in b.items() if v > 0})
    total = {k: sum(b.get(k, 0.0) for b in bundles) for k in keys}
    if strategy == "STRICT_PACK":
        if any(all(n.get(k, 0.0) >= total[k] for k in keys) for n in nodes):
            return None
        short = [
            f"{k}: the largest node has {_num(max((n.get(k, 0.0) for n in nodes), default=0))}"
            for k in keys
            if all(n.get(k, 0.0) < total[k] for n in nodes)
        ]
        return (
            f"needs {_fmt(total)} on one node (STRICT_PACK); "
            f"no node has that ({'; '.join(short) or 'no node has all of it at once'})"
        )
    have = {k: sum(n.get(k, 0.0) for n in nodes) for k in keys}
    missing = [f"{k}: needs {_num(total[k])}, the cluster has {_num(have[k])}" for k in keys if have[k] < total[k]]
    if missing:
        return f"needs {_fmt(total)} in all ({len(bundles)} bundles, {strategy}); {'; '.join(missing)}"
    free = [dict(n) for n in nodes]
    for b in sorted(bundles, key=lambda b: tuple(-b.get(k, 0.0) for k in keys)):
        node = next((n for n in free if all(n.get(k, 0.0) >= v for k, v in b.items())), None)
        if node is None:
            per_node = ", ".join(_fmt({k: n.get(k, 0.0) for k in keys}) for n in nodes)
            return (
                f"its {len(bundles)} bundles ({strategy}) do not fit the nodes' sizes ({per_node}): "
                f"a bundle of {_fmt(b)} finds no room"
            )
        for k, v in b.items():
            node[k] = node.get(k, 0.0) - v
    return None


def parts_unplaceable(plan: PlacementPlan, node_gpus: Sequence[float] | list[float]) -> str | None:
    """Why one replica's node parts (PlacementPlan.node_parts) cannot each get a node of these free GPU counts (first
    fit, largest first), naming the fix; None if they can, and then the GPUs they took are taken from `node_gpus` (a
    list: `summit validate` packs replica after replica into it). The same rule for `summit validate` (the nodes it
    is told of) and `serve deploy` (the live nodes)."""
    free, largest = list(node_gpus), max(node_gpus, default=0)
    tp = plan.tensor_parallel_size
    for size in sorted(plan.node_parts, reverse=True):
        node = next((i for i, f in enumerate(free) if f >= size), None)
        if node is None:
            fix = ""
            if size > largest and tp <= largest:
                fix = (
                    f". Fix: set the model's `gpus_per_node: {_num(largest)}` (it plans nodes of "
                    f"{plan.gpus_per_node} GPUs), so that each replica is split over nodes of that size"
                )
            elif size > largest:
                fix = (
                    f". Fix: a tensor-parallel group ({tp} GPUs) must share one node and no node has {tp}: lower "
                    f"tensor_parallel_size to {_num(largest)} or less (pipeline_parallel_size for the rest), or add "
                    f"nodes of {tp} GPUs"
                )
            return f"needs {size} GPUs on one node; free GPUs per node: {[_num(f) for f in free]}{fix}"
        free[node] -= size
    if isinstance(node_gpus, list):
        node_gpus[:] = free
    return None


def _num(x: float) -> str:
    return f"{x:g}"


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in resources.items()) + "}"
