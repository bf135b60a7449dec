"""Placement plans for TP × PP, computed without Ray or GPUs."""

from __future__ import annotations

import sys

import pytest

from app.build.placement import (
    PlacementPlan,
    placement_deployment_options,
    plan_placement,
    split_tp_groups,
    unplaceable,
)

GPU_WORKER = {"GPU": 1.0, "CPU": 1.0}


def test_module_is_pure():
    import subprocess

    code = (
        "import sys, app.build.placement; assert not {'ray', 'vllm', 'torch'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_8b_on_one_gpu_merges_the_replica_actor_into_bundle_0():
    plan = plan_placement(1, 1, "gpu", gpus_per_node=8, num_cpus=1.0)
    assert plan.bundles == ({"GPU": 1.0, "CPU": 2.0},)
    assert plan.strategy == "STRICT_PACK" and plan.expected_nodes == (0,)
    assert plan.num_gpus == 1 and plan.num_nodes == 1


def test_70b_tp4_is_one_strict_pack_group():
    plan = plan_placement(4, 1, "gpu", gpus_per_node=8, num_cpus=1.0)
    assert plan.bundles == ({"GPU": 1.0, "CPU": 2.0},) + (GPU_WORKER,) * 3
    assert plan.strategy == "STRICT_PACK" and plan.expected_nodes == (0, 0, 0, 0)
    assert list(plan.tp_group(0)) == [0, 1, 2, 3]


def test_70b_tp2_pp2_orders_bundles_stage_by_stage():
    plan = plan_placement(2, 2, "gpu", gpus_per_node=8, num_cpus=0.5)
    assert len(plan.bundles) == 4 and plan.bundles[0] == {"GPU": 1.0, "CPU": 1.5}
    assert plan.strategy == "STRICT_PACK"
    assert [list(plan.tp_group(s)) for s in range(2)] == [[0, 1], [2, 3]]


def test_405b_tp8_pp2_spans_two_8_gpu_nodes_one_stage_each():
    plan = plan_placement(8, 2, "gpu", gpus_per_node=8, num_cpus=1.0)
    assert plan.strategy == "PACK" and plan.num_gpus == 16 and plan.num_nodes == 2
    assert plan.expected_nodes == (0,) * 8 + (1,) * 8
    assert plan.bundles[0] == {"GPU": 1.0, "CPU": 2.0} and plan.bundles[1:] == (GPU_WORKER,) * 15
    options = placement_deployment_options(plan)
    assert options["placement_group_strategy"] == "PACK"
    assert options["placement_group_bundles"][8] == GPU_WORKER and len(options["placement_group_bundles"]) == 16


def test_tp4_pp4_on_8_gpu_nodes_keeps_each_tp_group_inside_a_node():
    plan = plan_placement(4, 4, "gpu", gpus_per_node=8)
    for stage in range(4):
        assert len({plan.expected_nodes[i] for i in plan.tp_group(stage)}) == 1


def test_cpu_is_one_bundle_with_the_actor_cpus():
    plan = plan_placement(2, 1, "cpu", num_cpus=0.5)
    assert plan.bundles == ({"CPU": 0.5},) and plan.strategy == "STRICT_PACK"
    assert placement_deployment_options(plan) == {
        "placement_group_bundles": [{"CPU": 0.5}],
        "placement_group_strategy": "STRICT_PACK",
    }
    with pytest.raises(ValueError, match=r"deployment.num_cpus must be > 0"):
        plan_placement(1, 1, "cpu", num_cpus=0)


def test_tp_that_does_not_tile_the_nodes_is_refused_with_the_fix():
    with pytest.raises(ValueError) as e:
        plan_placement(3, 4, "gpu", gpus_per_node=8)
    text = str(e.value)
    assert "tensor_parallel_size=3" in text and "gpus_per_node=8" in text and "allow_cross_node_tp" in text


def test_tp_larger_than_a_node_is_refused_unless_allowed():
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=16 is larger than gpus_per_node=8.*pipeline_parallel_size"
    ):
        plan_placement(16, 1, "gpu", gpus_per_node=8)
    plan = plan_placement(16, 1, "gpu", gpus_per_node=8, allow_cross_node_tp=True)
    assert plan.strategy == "PACK" and plan.expected_nodes == (0,) * 8 + (1,) * 8
    assert plan_placement(3, 4, "gpu", gpus_per_node=8, allow_cross_node_tp=True).num_gpus == 12


def test_tp3_fits_one_node_when_the_replica_does():
    assert plan_placement(3, 2, "gpu", gpus_per_node=8).strategy == "STRICT_PACK"


@pytest.mark.parametrize(
    ("tp", "pp", "gpn", "key"),
    [
        (0, 1, 8, "tensor_parallel_size=0"),
        (1, 0, 8, "pipeline_parallel_size=0"),
        (1, 1, 0, "gpus_per_node=0"),
        (-2, 1, 8, "tensor_parallel_size=-2"),
    ],
)
def test_zero_or_negative_sizes_name_the_key(tp, pp, gpn, key):
    with pytest.raises(ValueError, match=key):
        plan_placement(tp, pp, "gpu", gpus_per_node=gpn)


def test_unknown_accelerator_is_named():
    with pytest.raises(ValueError, match="accelerator='tpu'"):
        plan_placement(1, 1, "tpu")  # type: ignore[arg-type]


def test_plan_is_frozen():
    plan = plan_placement(1, 1)
    assert isinstance(plan, PlacementPlan)
    with pytest.raises(AttributeError):
        plan.strategy = "PACK"  # type: ignore[misc]


def test_split_tp_groups_reports_stages_that_crossed_nodes():
    plan = plan_placement(8, 2, "gpu", gpus_per_node=8)
    assert split_tp_groups(plan, ["a"] * 8 + ["b"] * 8) == []
    assert split_tp_groups(plan, ["a"] * 6 + ["b"] * 10) == [0]
    with pytest.raises(ValueError, match="16 bundles"):
        split_tp_groups(plan, ["a"])
    assert split_tp_groups(plan_placement(1, 1, "cpu", num_cpus=1), ["a"]) == []


NODE_8GPU = {"GPU": 8.0, "CPU": 192.0, "memory": 2e12, "node:10.0.0.1": 1.0}


def test_405b_plan_is_placeable_on_two_8_gpu_nodes_but_not_one():
    plan = plan_placement(8, 2, "gpu", gpus_per_node=8)
    assert unplaceable(plan.bundles, plan.strategy, [NODE_8GPU, NODE_8GPU]) is None
    why = unplaceable(plan.bundles, plan.strategy, [NODE_8GPU])
    assert why is not None and "GPU: needs 16, the cluster has 8" in why


def test_strict_pack_needs_one_node_holding_everything():
    plan = plan_placement(4, 1, "gpu", gpus_per_node=8)
    assert unplaceable(plan.bundles, plan.strategy, [NODE_8GPU]) is None
    small = {"GPU": 2.0, "CPU": 64.0}
    why = unplaceable(plan.bundles, plan.strategy, [small, small, small])  # 6 GPUs in all, but 2 per node
    assert why is not None and "on one node (STRICT_PACK)" in why and "GPU: the largest node has 2" in why
    assert "CPU" not in why.split("no node has that")[1]  # CPUs are not what is missing


def test_pack_fails_on_fragmented_nodes_and_says_so():
    bundles = [{"GPU": 1.0, "CPU": 3.0}] * 2
    nodes = [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0, "CPU": 5.0}]  # totals suffice, sizes do not
    why = unplaceable(bundles, "PACK", nodes)
    assert why is not None and "do not fit the nodes' sizes" in why and "{GPU: 1, CPU: 3}" in why
    assert unplaceable(bundles, "PACK", [{"GPU": 1.0, "CPU": 3.0}, {"GPU": 1.0, "CPU": 5.0}]) is None


def test_cpu_replica_and_resources_it_does_not_ask_for():
    assert unplaceable([{"CPU": 0.5, "GPU": 0.0}], "STRICT_PACK", [{"CPU": 2.0}]) is None  # GPU 0 is not a need
    why = unplaceable([{"CPU": 4.0}], "STRICT_PACK", [{"CPU": 2.0}, {"CPU": 2.0}])
    assert why is not None and "CPU: the largest node has 2" in why
    assert unplaceable([{"GPU": 1.0}], "PACK", []) is not None  # no nodes at all
