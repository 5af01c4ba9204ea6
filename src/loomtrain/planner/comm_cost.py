"""Alpha-beta costs of the collectives a plan runs, on the level of the hierarchy each group
spans (docs/planner.md, "Communication").

A message of S bytes costs alpha + S / beta (Hockney's model). The ring algorithms over n
ranks (Thakur, Rabenseifner & Gropp 2005; what NCCL and loomtrain's comm/ring.py run):
- all-reduce: 2(n-1) steps of S/n each: 2(n-1) alpha + 2(n-1)/n S / beta;
- all-gather, reduce-scatter (S the whole gathered tensor): (n-1) alpha + (n-1)/n S / beta;
- send (point to point): alpha + S / beta.
The wire bytes one rank sends are the same fractions of S (DESIGN.md, principle 3).

Which link a group uses follows the mesh (mesh.py): ranks are laid out pp, dp, cp, tp with
tp innermost, so an axis's group has stride = the product of the sizes inside it. The group
stays in one node when stride x size <= devices per node; otherwise the ring crosses the
network and every step runs at the network's speed (its slowest link).
"""

from __future__ import annotations

from loomtrain.planner.specs import ClusterSpec

INNER = {"tp": (), "cp": ("tp",), "dp": ("cp", "tp"), "pp": ("dp", "cp", "tp")}


def spans_nodes(cluster: ClusterSpec, sizes: dict[str, int], axis: str) -> bool:
    """Does `axis`'s group (sizes: the mesh, axis -> ranks) cross a node boundary?"""
    stride = 1
    for inner in INNER[axis]:
        stride *= sizes[inner]
    return sizes[axis] > 1 and stride * sizes[axis] > cluster.gpus_per_node


def link(cluster: ClusterSpec, crosses: bool, n: int) -> tuple[float, float]:
    """(alpha_s, beta bytes/s) of one step of a collective over n ranks. cpu-here carries a
    fit per group size measured on gloo (calibrate.py): the nearest size's fit is used."""
    d = cluster.device
    if d.collective_fit:
        fit = min(d.collective_fit, key=lambda row: (abs(row[0] - n), -row[0]))
        return fit[1], fit[2]
    if crosses:
        return d.inter_node_latency_s, cluster.inter_bytes_per_s
    return d.intra_node_latency_s, d.intra_node_bytes_per_s


def all_reduce_s(cluster: ClusterSpec, payload_bytes: float, n: int, crosses: bool) -> float:
    if n == 1:
        return 0.0
    alpha, beta = link(cluster, crosses, n)
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * payload_bytes / beta


def gather_s(cluster: ClusterSpec, payload_bytes: float, n: int, crosses: bool) -> float:
    """All-gather or reduce-scatter of a tensor of `payload_bytes` (whole) over n ranks."""
    if n == 1:
        return 0.0
    alpha, beta = link(cluster, crosses, n)
    return (n - 1) * alpha + (n - 1) / n * payload_bytes / beta


def send_s(cluster: ClusterSpec, payload_bytes: float, crosses: bool) -> float:
    alpha, beta = link(cluster, crosses, 2)
    return alpha + payload_bytes / beta


def all_reduce_wire(payload_bytes: float, n: int) -> float:
    return 2 * (n - 1) / n * payload_bytes if n > 1 else 0.0


def gather_wire(payload_bytes: float, n: int) -> float:
    return (n - 1) / n * payload_bytes if n > 1 else 0.0
