"""The mesh: grid coordinates, axis groups and node splits (pure), and the sub-groups live."""

from __future__ import annotations

import pytest
import torch

from harness import run_world
from loomtrain import comm
from loomtrain.mesh import (AXES, Mesh, axis_groups, build_mesh, expert_groups, grid_coords,
                            split_by_node)

# world 8, pp=2 dp=2 tp=2 (tp innermost):   pp0: dp0 [0 1]  dp1 [2 3]   pp1: dp0 [4 5]  dp1 [6 7]
SIZES_8 = {"pp": 2, "dp": 2, "cp": 1, "tp": 2}


def test_grid_coords_put_tp_innermost_and_pp_outermost():
    assert grid_coords(0, SIZES_8) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert grid_coords(5, SIZES_8) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert grid_coords(6, SIZES_8) == {"pp": 1, "dp": 1, "cp": 0, "tp": 0}
    sizes = {"pp": 3, "dp": 2, "cp": 2, "tp": 2}
    for rank in range(24):  # the coordinates are the row-major index into (pp, dp, cp, tp)
        c = grid_coords(rank, sizes)
        assert ((c["pp"] * 2 + c["dp"]) * 2 + c["cp"]) * 2 + c["tp"] == rank


def test_axis_groups_of_world_8():
    assert axis_groups(SIZES_8, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(SIZES_8, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(SIZES_8, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(SIZES_8, "cp") == [[r] for r in range(8)]
    for axis in AXES:  # every rank is in exactly one group of every axis
        assert sorted(r for g in axis_groups(SIZES_8, axis) for r in g) == list(range(8))


def test_expert_groups_cut_dp_with_ep_innermost():
    # world 8, dp=4 tp=2: dp groups [0 2 4 6] and [1 3 5 7]; ep = 2 of them hold different
    # experts (dp // 2 shared), edp = the ranks at the same place in each (dp % 2 shared)
    sizes = {"pp": 1, "dp": 4, "cp": 1, "tp": 2}
    ep, edp = expert_groups(sizes, 2)
    assert ep == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert edp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert expert_groups(sizes, 1) == ([[r] for r in range(8)], axis_groups(sizes, "dp"))
    assert expert_groups(sizes, 4) == (axis_groups(sizes, "dp"), [[r] for r in range(8)])
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        expert_groups(sizes, 3)


def test_split_by_node_with_4_ranks_per_node():
    # tp and dp groups live inside one node; pp groups cross the two nodes
    for axis in ("tp", "dp"):
        local, cross = split_by_node(axis_groups(SIZES_8, axis), 4)
        assert local == axis_groups(SIZES_8, axis)
        assert cross == [[r] for g in axis_groups(SIZES_8, axis) for r in g]
    local, cross = split_by_node(axis_groups(SIZES_8, "pp"), 4)
    assert local == [[r] for r in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert cross == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_split_by_node_with_2_ranks_per_node_splits_dp_of_4():
    sizes = {"pp": 1, "dp": 4, "cp": 1, "tp": 1}
    local, cross = split_by_node(axis_groups(sizes, "dp"), 2)
    assert local == [[0, 1], [2, 3]]
    assert cross == [[0, 2], [1, 3]]  # same node-local index, one from each node


def test_uneven_spread_over_nodes_is_refused():
    with pytest.raises(ValueError, match=r"group \[0, 1, 2\] spreads unevenly"):
        split_by_node([[0, 1, 2]], 2)
    with pytest.raises(ValueError, match="unevenly"):  # 3 ranks of node 0, 1 of node 1
        split_by_node([[0, 1, 2, 4]], 4)


def test_describe_draws_the_grid():
    mesh = Mesh(sizes=SIZES_8, rank=0, ranks_per_node=4, device=torch.device("cpu"))
    assert mesh.describe() == (
        "mesh pp=2 dp=2 cp=1 tp=2 (world 8, 2 node(s) of 4 ranks)\n"
        "  pp0: dp0/cp0 [0 1]  dp1/cp0 [2 3]\n"
        "  pp1: dp0/cp0 [4 5]  dp1/cp0 [6 7]"
    )


def _node_sums(rank, world):
    mesh = build_mesh({"dp": world}, ranks_per_node=2)
    local, cross = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    comm.all_reduce(local, mesh, "dp.local")
    comm.all_reduce(cross, mesh, "dp.cross")
    return {
        "local": local.item(), "cross": cross.item(),
        "groups": (mesh.group_ranks("dp.local"), mesh.group_ranks("dp.cross")),
        "sizes": (mesh.size("dp.local"), mesh.size("dp.cross"), mesh.nodes, mesh.node),
        "metered": (mesh.meter.total("payload_bytes", axis="dp.local"),
                    mesh.meter.total("payload_bytes", axis="dp.cross")),
        "describe": mesh.describe(),
    }


def test_node_local_and_cross_node_all_reduce_on_world_4():
    results = run_world(_node_sums, 4, timeout_s=90)
    # nodes {0, 1} and {2, 3}: local sums 0+1, 2+3; cross pairs (0, 2) and (1, 3)
    assert [r["local"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["cross"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert results[3]["groups"] == ([2, 3], [1, 3])
    assert [r["sizes"] for r in results] == [(2, 2, 2, 0), (2, 2, 2, 0), (2, 2, 2, 1), (2, 2, 2, 1)]
    assert all(r["metered"] == (4, 4) for r in results)  # one fp32 each, counted per sub-axis
    assert results[0]["describe"] == (
        "mesh pp=1 dp=4 cp=1 tp=1 (world 4, 2 node(s) of 2 ranks)\n"
        "  pp0: dp0/cp0 [0]  dp1/cp0 [1]  dp2/cp0 [2]  dp3/cp0 [3]"
    )
