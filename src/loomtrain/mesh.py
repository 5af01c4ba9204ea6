"""The named device mesh: every rank's place on the (pp, dp, cp, tp) grid.

The grid is `arange(world).view(pp, dp, cp, tp)`, tp innermost; expert parallelism cuts dp
into "ep" x "edp" (`expert_groups`; "edpcp", edp with its cp peers: `expert_replicas`);
`ranks_per_node` adds node-local and cross-node sub-groups for hierarchical methods, and
`mesh.link` a simulated slow link between nodes. The layout, with an example:
docs/architecture.md, "The mesh".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from loomtrain.comm.activity import Activity
from loomtrain.comm.meter import CommMeter

if TYPE_CHECKING:
    from loomtrain.comm.link import SlowLink

AXES = ("pp", "dp", "cp", "tp")


def grid_coords(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Coordinates of `rank` on the (pp, dp, cp, tp) grid; pure, tested without processes."""
    coords = {}
    for axis in reversed(AXES):
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return coords


def axis_groups(sizes: dict[str, int], axis: str) -> list[list[int]]:
    """All groups of ranks that differ only in their `axis` coordinate, in rank order."""
    grid = torch.arange(_prod(sizes.values())).view(*(sizes[a] for a in AXES))
    dim = AXES.index(axis)
    moved = grid.movedim(dim, -1).reshape(-1, sizes[axis])
    return sorted(row.tolist() for row in moved)


def expert_groups(sizes: dict[str, int], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, edp groups), as TorchTitan and Megatron-Core cut dp for expert parallelism,
    ep innermost: each dp group, in dp order, cut into runs of `ep` consecutive members (the
    ranks that hold different experts and exchange tokens: dp coordinate // ep shared), and
    the members at the same place in every run (the ranks that hold the same experts and
    reduce their gradients: dp coordinate % ep shared). Pure."""
    ep_groups, edp_groups = [], []
    for group in axis_groups(sizes, "dp"):
        if len(group) % ep:
            raise ValueError(f"ep={ep} does not divide dp={len(group)}")
        ep_groups += [group[i:i + ep] for i in range(0, len(group), ep)]
        edp_groups += [group[j::ep] for j in range(ep)]
    return sorted(ep_groups), sorted(edp_groups)


def expert_replicas(sizes: dict[str, int], ep: int) -> list[list[int]]:
    """The "edpcp" groups: the ranks that hold the same experts under context parallelism,
    an edp group (`expert_groups`) with its cp peers (the ranks that share their (pp, tp)
    coordinates and their dp coordinate % ep), as "dpcp" is dp with its cp peers: each cp
    rank of a replica holds the same weights and the gradient of its own tokens. Pure."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for rank in range(_prod(sizes.values())):
        c = grid_coords(rank, sizes)
        groups.setdefault((c["pp"], c["tp"], c["dp"] % ep), []).append(rank)
    return sorted(groups.values())


def split_by_node(groups: list[list[int]], ranks_per_node: int) -> tuple[list, list]:
    """Split each axis group into node-local sub-groups and cross-node sub-groups.

    Node-local: members of one group that share a node. Cross-node: the members with the same
    position inside their node-local sub-group, one from every node. Pure.
    """
    local, cross = [], []
    for group in groups:
        by_node: dict[int, list[int]] = {}
        for r in group:
            by_node.setdefault(r // ranks_per_node, []).append(r)
        parts = list(by_node.values())
        local.extend(parts)
        if len({len(p) for p in parts}) != 1:
            raise ValueError(f"group {group} spreads unevenly over nodes of {ranks_per_node} ranks")
        cross.extend([p[i] for p in parts] for i in range(len(parts[0])))
    return local, cross


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass
class Mesh:
    """This rank's view of the mesh: sizes, coordinates, process groups, and the CommMeter."""

    sizes: dict[str, int]
    rank: int
    ranks_per_node: int
    device: torch.device
    device_mesh: DeviceMesh | None = None
    meter: CommMeter = field(default_factory=CommMeter)
    _groups: dict[str, object] = field(default_factory=dict)
    # per (axis, op): how many ring ops this rank has issued; names each one for p2p tags
    ring_sequence: dict[tuple[str, str], int] = field(default_factory=dict)
    # the simulated slow wire between nodes that comm/ delays cross-node ops by (None: none)
    link: SlowLink | None = None
    # the collectives this rank entered and the one it is blocked in, for the heartbeat
    activity: Activity = field(default_factory=Activity)

    def __deepcopy__(self, memo) -> "Mesh":
        """A copy of a model that holds the mesh (the pipeline's shape inference on the meta
        device) shares it: process groups cannot be copied."""
        return self

    @property
    def world(self) -> int:
        return _prod(self.sizes.values())

    @property
    def coords(self) -> dict[str, int]:
        return grid_coords(self.rank, self.sizes)

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def size(self, axis: str) -> int:
        """Size of an axis, or of a sub-group: "dp", "ep", "edp", "dp.local", "dp.cross",
        "edp.local", "edp.cross"."""
        if axis in self.sizes:
            return self.sizes[axis]
        return len(self._member_ranks(axis))

    def local_rank(self, axis: str) -> int:
        if axis in self.sizes:
            return self.coords[axis]
        return self._member_ranks(axis).index(self.rank)

    def group(self, axis: str):
        """The process group of `axis` ("dp", "tp", ..., "dpcp" (dp and cp together), "ep"
        and "edp" (dp cut for expert parallelism, `expert_groups`), "edpcp" (edp and cp
        together, `expert_replicas`), "dp.local", "dp.cross", "dpcp.local", "dpcp.cross",
        "edp.local", "edp.cross", "world", or "self": this rank alone, for code that treats
        "not sharded" as a group of one)."""
        return self._groups[axis][1]

    def group_ranks(self, axis: str) -> list[int]:
        return self._member_ranks(axis)

    def _member_ranks(self, axis: str) -> list[int]:
        return self._groups[axis][0]

    def describe(self) -> str:
        """The grid as text, one line per pipeline stage, tensor-parallel peers in brackets."""
        grid = torch.arange(self.world).view(*(self.sizes[a] for a in AXES))
        lines = [
            "mesh " + " ".join(f"{a}={self.sizes[a]}" for a in AXES)
            + f" (world {self.world}, {self.nodes} node(s) of {self.ranks_per_node} ranks)"
        ]
        for pp in range(self.sizes["pp"]):
            cells = []
            for dp in range(self.sizes["dp"]):
                for cp in range(self.sizes["cp"]):
                    tp = " ".join(str(r) for r in grid[pp, dp, cp].tolist())
                    cells.append(f"dp{dp}/cp{cp} [{tp}]")
            lines.append(f"  pp{pp}: " + "  ".join(cells))
        return "\n".join(lines)


def build_mesh(
    sizes: dict[str, int],
    ranks_per_node: int | None = None,
    device: torch.device | str = "cpu",
    link: SlowLink | None = None,
) -> Mesh:
    """Build the mesh over the already-initialized default process group.

    Every rank must call this with the same arguments: creating sub-groups is collective.
`sizes` may hold "ep", the expert-parallel sub-axis of dp (`expert_groups`; default 1).
    `link`: a simulated slow wire between the nodes of `ranks_per_node` (comm/link.py).
    """
    ep = int(sizes.get("ep", 1))
    sizes = {a: int(sizes.get(a, 1)) for a in AXES}
    world = dist.get_world_size()
    if _prod(sizes.values()) != world:
        raise ValueError(f"mesh {sizes} has {_prod(sizes.values())} ranks, world has {world}")
    ranks_per_node = ranks_per_node or world
    if link is not None and link.ranks_per_node != ranks_per_node:
        raise ValueError(f"the link's nodes of {link.ranks_per_node} ranks differ from the "
                         f"mesh's ranks_per_node={ranks_per_node}")
    device = torch.device(device)
    device_mesh = init_device_mesh(device.type, tuple(sizes[a] for a in AXES), mesh_dim_names=AXES)
    mesh = Mesh(sizes=sizes, rank=dist.get_rank(), ranks_per_node=ranks_per_node,
                device=device, device_mesh=device_mesh, link=link)
    mesh._groups["world"] = (list(range(world)), dist.group.WORLD)
    mesh._groups["self"] = ([mesh.rank], None)  # a one-rank axis: every op on it is a no-op
    for axis in AXES:
        ranks = next(g for g in axis_groups(sizes, axis) if mesh.rank in g)
        mesh._groups[axis] = (ranks, device_mesh.get_group(axis))
    # dp and cp together: the ranks that hold the same parameters (context-parallel peers hold
    # the same replica but different tokens), which the data-parallel engine reduces over
    dpcp = axis_groups({"pp": sizes["pp"], "dp": 1, "cp": sizes["dp"] * sizes["cp"],
                        "tp": sizes["tp"]}, "cp")
    if sizes["cp"] == 1:
        mesh._groups["dpcp"] = mesh._groups["dp"]
    else:
        for ranks in dpcp:
            pg = dist.new_group(ranks)  # collective: every rank creates every group
            if mesh.rank in ranks:
                mesh._groups["dpcp"] = (ranks, pg)
    _add_expert_groups(mesh, ep)
    groups = {axis: axis_groups(sizes, axis) for axis in AXES}
    if sizes["cp"] > 1:
        groups["dpcp"] = dpcp  # hierarchical ZeRO under cp shards inside a node over dp x cp
    if 1 < ep < sizes["dp"]:
        groups["edp"] = expert_groups(sizes, ep)[1]  # hierarchical ZeRO's experts
    for axis, every in groups.items():
        if ranks_per_node == world:
            mesh._groups[f"{axis}.local"] = mesh._groups[axis]
            mesh._groups[f"{axis}.cross"] = ([mesh.rank], None)
            continue
        local, cross = split_by_node(every, ranks_per_node)
        for name, parts in ((f"{axis}.local", local), (f"{axis}.cross", cross)):
            for ranks in parts:  # new_group is collective: every rank creates every group
                pg = dist.new_group(ranks) if len(ranks) > 1 else None
                if mesh.rank in ranks:
                    mesh._groups[name] = (ranks, pg)
    for part in ("local", "cross"):
        if sizes["cp"] == 1:
            mesh._groups[f"dpcp.{part}"] = mesh._groups[f"dp.{part}"]
        if ep == 1 or ep == sizes["dp"]:  # edp is dp, or this rank alone
            mesh._groups[f"edp.{part}"] = mesh._groups[f"dp.{part}" if ep == 1 else "self"]
    return mesh


def _add_expert_groups(mesh: Mesh, ep: int) -> None:
    """The "ep" and "edp" groups (`expert_groups`): at ep = 1 this rank alone and dp, at
    ep = dp dp and this rank alone; otherwise new groups (collective: every rank creates
    every group). "edpcp" (`expert_replicas`): edp at cp = 1, "dpcp" at ep = 1, cp at
    ep = dp."""
    if ep == 1 or ep == mesh.sizes["dp"]:
        alone, dp = mesh._groups["self"], mesh._groups["dp"]
        mesh._groups["ep"], mesh._groups["edp"] = (alone, dp) if ep == 1 else (dp, alone)
    else:
        _new_groups(mesh, zip(("ep", "edp"), expert_groups(mesh.sizes, ep)))
    if mesh.sizes["cp"] == 1 or ep == 1:
        mesh._groups["edpcp"] = mesh._groups["edp" if mesh.sizes["cp"] == 1 else "dpcp"]
    elif ep == mesh.sizes["dp"]:
        mesh._groups["edpcp"] = mesh._groups["cp"]
    else:
        _new_groups(mesh, [("edpcp", expert_replicas(mesh.sizes, ep))])


def _new_groups(mesh: Mesh, axes) -> None:
    """(axis, every group of it) pairs as process groups, this rank's kept under the axis
    (collective: every rank creates every group)."""
    for axis, parts in axes:
        for ranks in parts:
            pg = dist.new_group(ranks)
            if mesh.rank in ranks:
                mesh._groups[axis] = (ranks, pg)
