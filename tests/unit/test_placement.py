"""Placement plans for TP × PP, computed without Ray or GPUs."""

from __future__ import annotations

import sys

import pytest

from app.placement import PlacementPlan, placement_deployment_options, plan_placement, split_tp_groups

GPU_WORKER = {"GPU": 1.0, "CPU": 1.0}


def test_module_is_pure():
    import subprocess

    code = "import sys, app.placement; assert not {'ray', 'vllm', 'torch'} & set(sys.modules), sorted(sys.modules)"
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
    assert placement_deployment_options(plan) == {"placement_group_bundles": [{"CPU": 0.5}],
                                                  "placement_group_strategy": "STRICT_PACK"}
    with pytest.raises(ValueError, match=r"deployment.num_cpus must be > 0"):
        plan_placement(1, 1, "cpu", num_cpus=0)


def test_tp_that_does_not_tile_the_nodes_is_refused_with_the_fix():
    with pytest.raises(ValueError) as e:
        plan_placement(3, 4, "gpu", gpus_per_node=8)
    text = str(e.value)
    assert "tensor_parallel_size=3" in text and "gpus_per_node=8" in text and "allow_cross_node_tp" in text


def test_tp_larger_than_a_node_is_refused_unless_allowed():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=16 is larger than gpus_per_node=8.*pipeline_parallel_size"):
        plan_placement(16, 1, "gpu", gpus_per_node=8)
    plan = plan_placement(16, 1, "gpu", gpus_per_node=8, allow_cross_node_tp=True)
    assert plan.strategy == "PACK" and plan.expected_nodes == (0,) * 8 + (1,) * 8
    assert plan_placement(3, 4, "gpu", gpus_per_node=8, allow_cross_node_tp=True).num_gpus == 12


def test_tp3_fits_one_node_when_the_replica_does():
    assert plan_placement(3, 2, "gpu", gpus_per_node=8).strategy == "STRICT_PACK"


@pytest.mark.parametrize(("tp", "pp", "gpn", "key"), [
    (0, 1, 8, "tensor_parallel_size=0"),
    (1, 0, 8, "pipeline_parallel_size=0"),
    (1, 1, 0, "gpus_per_node=0"),
    (-2, 1, 8, "tensor_parallel_size=-2"),
])
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
