"""Rank layout: roles, routing, node placement, and layouts that must be refused in words."""
from __future__ import annotations

import pytest

from hpc_tba.config import ClusterConfig
from hpc_tba.config.topology import LayoutError, Role, Topology


def test_one_machine_roles_and_routing():
    t = Topology.build(3, 1, 2)
    assert [t.role(r) for r in range(3)] == [Role.LEARNER, Role.SEARCHER, Role.SEARCHER]
    assert t.learner_ranks == [0] and t.searcher_ranks == [1, 2] and t.sync_ranks == [0, 1, 2]
    assert t.searcher_index(2) == 1
    assert t.tasks_per_node == [3] and t.node_of(2) == 0 and t.devices_of(0) == [0]
    t2 = Topology.build(5, 2, 3)
    # every sample of a prompt goes to one shard; searcher slices cover all prompts once
    assert [t2.shard_of_prompt(p) for p in range(5)] == [0, 1, 0, 1, 0]
    covered = sorted(p for s in range(3) for p in t2.prompts_of_searcher(s, 10))
    assert covered == list(range(10))


def test_70b_placement_learners_whole_nodes_engines_packed():
    t = Topology.build(80, 64, 16, num_nodes=16, slots_per_node=8, tp_size=4)
    assert (t.learner_nodes, t.searcher_nodes, t.engines_per_node) == (8, 8, 2)
    assert t.tasks_per_node == [8] * 8 + [2] * 8
    assert t.node_of(63) == 7 and t.node_of(64) == 8 and t.node_of(79) == 15
    assert t.devices_of(9) == [1]                                  # learner: one GPU
    assert t.devices_of(64) == [0, 1, 2, 3] and t.devices_of(65) == [4, 5, 6, 7]  # TP groups
    assert all(t.role(r) is Role.LEARNER for r in t.ranks_on_node(7))
    assert t.sync_ranks == [0] + list(range(64, 80))


def test_partial_last_searcher_node():
    t = Topology.build(11, 8, 3, num_nodes=3, slots_per_node=8, tp_size=4)
    assert t.tasks_per_node == [8, 2, 1]


def test_from_cluster_cpu_nodes():
    t = Topology.from_cluster(ClusterConfig(backend="slurm", nodes=3, ranks_per_node=1))
    assert t.tasks_per_node == [1, 1, 1] and t.node_of(2) == 2
    assert "node 0: ranks 0 (learner" in t.describe()


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=3, num_learners=0, num_searchers=3), "at least 1"),
    (dict(world_size=1, num_learners=1, num_searchers=0), "no searcher"),
    (dict(world_size=4, num_learners=1, num_searchers=2), "but the job has 4"),
    (dict(world_size=12, num_learners=4, num_searchers=8, num_nodes=2, slots_per_node=8),
     "do not fill whole nodes"),
    (dict(world_size=10, num_learners=8, num_searchers=2, num_nodes=2, slots_per_node=8,
          tp_size=3), "must divide the 8"),
    (dict(world_size=40, num_learners=32, num_searchers=8, num_nodes=5, slots_per_node=8,
          tp_size=4), "need 4 nodes"),
    (dict(world_size=3, num_learners=1, num_searchers=2, num_nodes=3), "no slots per node"),
    (dict(world_size=3, num_learners=1, num_searchers=2, tp_size=2), "needs GPUs"),
])
def test_impossible_layouts_say_why(kwargs, words):
    with pytest.raises(LayoutError, match=words):
        Topology.build(**kwargs)


def test_offline_algorithms_need_no_searcher():
    assert Topology.build(2, 2, 0, needs_searchers=False).searcher_ranks == []


def test_cluster_config_validation():
    with pytest.raises(ValueError, match="not a Slurm time"):
        ClusterConfig(time="two days")
    with pytest.raises(ValueError, match="ranks_per_node"):
        ClusterConfig(nodes=2)
    assert ClusterConfig(time="2-00:00:00").time == "2-00:00:00"
