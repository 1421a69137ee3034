"""The planner across nodes (issue 11, item 4): GPUs per node in, ranks per node out."""

import itertools
from pathlib import Path

import pytest

from ftmaster.recovery.planner import PlanError, assign_ranks, plan_layout, plan_nodes, uniform_nodes
from helpers.launch import train_args  # the multi-node issue's own test command

SMALL = ["t.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
         "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "1"]


def shape(plan):
    return (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
            plan.data_parallel_size, plan.micro_batch_size, plan.num_gpus_used)


@pytest.mark.parametrize("nodes, tp, world, expected", [
    pytest.param((8, 8, 7), 8, 16, (8, 8, 0), id="a-node-with-fewer-gpus-than-tp-stands-by"),
    pytest.param((8, 8, 7), 1, 20, (8, 8, 4), id="uneven-remainder-on-the-last-filled"),
    pytest.param((8, 8, 7), 1, 23, (8, 8, 7), id="every-gpu"),
    pytest.param((8, 8, 8), 8, 16, (8, 8, 0), id="a-whole-spare-node"),
    pytest.param((7, 8, 8), 8, 16, (0, 8, 8), id="whole-nodes-before-a-partly-failed-one"),
    pytest.param((7, 8, 8), 1, 16, (0, 8, 8), id="fewest-nodes-take-part"),
    pytest.param((8, 6, 8), 4, 20, (8, 4, 8), id="tp4-on-6-gpus-runs-4"),
    pytest.param((8, 8), 3, 12, (6, 6), id="tp3-on-8-gpu-nodes-runs-6-each"),
    pytest.param((2, 1), 1, 3, (2, 1), id="the-multi-node-issues-uneven-case"),
])
def test_ranks_per_node(nodes, tp, world, expected):
    ranks = assign_ranks(nodes, tp, world)
    assert ranks == expected
    assert sum(ranks) == world and all(r % tp == 0 and r <= n for r, n in zip(ranks, nodes))


@pytest.mark.parametrize("nodes, gbs, expected_shape, expected_ranks", [
    # Paper mode ranks by GPUs, then TP, then PP: TP8 (the command's) wherever 16 ranks fit.
    pytest.param((8, 8, 7), 32, (8, 2, 1, 1, 16), (8, 8, 0), id="tp8-spares-the-7-gpu-node"),
    pytest.param((4, 8, 8), 16, (8, 2, 1, 1, 16), (0, 8, 8), id="node-0-cannot-hold-tp8"),
    pytest.param((3, 3), 6, (1, 2, 3, 1, 6), (3, 3), id="nodes-smaller-than-the-commands-tp8"),
])
def test_plans_over_uneven_nodes(nodes, gbs, expected_shape, expected_ranks):
    command = [*SMALL, "--tensor-model-parallel-size", "8", "--global-batch-size", str(gbs)]
    plan = plan_nodes(command, nodes, mode="paper")
    assert (shape(plan), plan.ranks_per_node) == (expected_shape, expected_ranks)


def test_the_multi_node_issues_uneven_case():
    """Two nodes of 2 GPUs, TP2 x PP1 x DP2, global batch 12; node 1 loses a GPU: every node
    replans to TP1 x PP1 x DP3 with node 0 running 2 ranks and node 1 running 1."""
    command = ["pretrain_gpt.py", *train_args(Path("/ckpt"), 30, 2, 1, 5, global_batch=12)]
    plan = plan_nodes(command, [2, 1], original_world_size=4)
    assert (shape(plan)[:3], plan.ranks_per_node) == ((1, 1, 3), (2, 1))
    node_1_lost = plan_nodes(command, [2, 0], original_world_size=4)
    assert node_1_lost.ranks_per_node == (2, 0) and node_1_lost.num_gpus_used == 2


def test_a_permutation_of_equal_nodes_gives_the_same_shape():
    command = [*SMALL, "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
               "--global-batch-size", "16"]
    nodes = (8, 8, 7, 8, 5)
    plans = {order: plan_nodes(command, order, original_world_size=40)
             for order in set(itertools.permutations(nodes))}
    assert len({shape(plan) for plan in plans.values()}) == 1
    for order, plan in plans.items():  # the ranks follow the nodes, whole ones first
        assert sorted(zip(order, plan.ranks_per_node)) == sorted(zip(nodes, plans[nodes].ranks_per_node))


def test_the_answer_is_the_same_on_every_node():
    command = [*SMALL, "--tensor-model-parallel-size", "2", "--global-batch-size", "24"]
    first = plan_nodes(command, (8, 8, 6, 8), original_world_size=32)
    assert all(plan_nodes(command, (8, 8, 6, 8), original_world_size=32) == first for _ in range(3))


def test_uniform_gpus_are_equal_nodes_and_one_node_is_one_entry():
    command = [*SMALL, "--tensor-model-parallel-size", "4", "--global-batch-size", "24"]
    assert uniform_nodes(23, 8) == (8, 8, 7) and uniform_nodes(16, 8) == (8, 8)
    assert uniform_nodes(5, None) == (5,)
    assert plan_layout(command, 23, 8) == plan_nodes(command, (8, 8, 7))
    assert plan_layout(command, 5) == plan_nodes(command, (5,))
    assert plan_nodes(command, (5,)).ranks_per_node == (4,)


def test_hot_spare_node_keeps_the_original_layout():
    command = [*SMALL, "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
               "--global-batch-size", "16"]
    plan = plan_nodes(command, (8, 8, 8), original_world_size=16)
    assert shape(plan) == (4, 2, 2, 1, 16) and plan.ranks_per_node == (8, 8, 0)
    assert plan.reason == "the original layout fits (hot spare)"
    lost = plan_nodes(command, (8, 7, 8), original_world_size=16)  # the spare takes over
    assert shape(lost) == (4, 2, 2, 1, 16) and lost.ranks_per_node == (8, 0, 8)


@pytest.mark.parametrize("nodes, error, message", [
    ((), PlanError, "no layout fits 0 GPUs: at least one GPU is needed"),
    ((0, 0), PlanError, "no layout fits 0 GPUs: at least one GPU is needed"),
    ((8, -1), ValueError, r"GPUs per node cannot be negative, got \[8, -1\]"),
])
def test_bad_node_lists_are_one_line(nodes, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        plan_nodes([*SMALL, "--global-batch-size", "8"], nodes)
