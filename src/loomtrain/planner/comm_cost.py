"""Alpha-beta costs of the collectives a plan runs, on the level of the hierarchy each group
spans: Hockney's model with the ring algorithms of Thakur, Rabenseifner & Gropp (2005), or on
`cpu-here` what gloo measured plus its sync penalty. Formulas and the link rule:
docs/planner.md, "Communication".
"""

from __future__ import annotations

from loomtrain.planner.specs import ClusterSpec

# the axes inside each (mesh.py's order, tp innermost); ep is the run of ep consecutive dp ranks
INNER = {"tp": (), "cp": ("tp",), "ep": ("cp", "tp"), "dp": ("cp", "tp"), "pp": ("dp", "cp", "tp")}


def spans_nodes(cluster: ClusterSpec, sizes: dict[str, int], axis: str) -> bool:
    """Does `axis`'s group (sizes: the mesh, axis -> ranks) cross a node boundary?"""
    stride = 1
    for inner in INNER[axis]:
        stride *= sizes[inner]
    return sizes[axis] > 1 and stride * sizes[axis] > cluster.gpus_per_node


def _nearest(rows, n: int) -> int:
    """The group size among rows' first fields nearest n (the larger on a tie)."""
    return min({row[0] for row in rows}, key=lambda k: (abs(k - n), -k))


def link(cluster: ClusterSpec, crosses: bool, n: int) -> tuple[float, float]:
    """(alpha_s, beta bytes/s) of one step of a collective over n ranks. cpu-here carries a
    fit per group size measured on gloo (calibrate.py): the nearest size's fit is used."""
    d = cluster.device
    if d.collective_fit:
        k = _nearest(d.collective_fit, n)
        return next((a, b) for m, a, b in d.collective_fit if m == k)
    return point_link(cluster, crosses)


def point_link(cluster: ClusterSpec, crosses: bool) -> tuple[float, float]:
    """(alpha_s, beta bytes/s) of a point-to-point message (cpu-here: the send/recv fit)."""
    d = cluster.device
    if crosses:
        return d.inter_node_latency_s, cluster.inter_bytes_per_s
    return d.intra_node_latency_s, d.intra_node_bytes_per_s


def measured_all_reduce_s(table, payload_bytes: float, n: int) -> float:
    """The all-reduce time over n ranks (the nearest measured n) at `payload_bytes`, linear
    between the two measured sizes around it and along the last two beyond them."""
    k = _nearest(table, n)
    points = sorted((size, t) for m, size, t in table if m == k)
    if payload_bytes <= points[0][0]:
        return points[0][1]
    pairs = list(zip(points, points[1:]))
    (s0, t0), (s1, t1) = next(((a, b) for a, b in pairs if payload_bytes <= b[0]), pairs[-1])
    return t0 + (t1 - t0) * (payload_bytes - s0) / (s1 - s0)


def all_reduce_s(cluster: ClusterSpec, payload_bytes: float, n: int, crosses: bool) -> float:
    if n == 1:
        return 0.0
    if cluster.device.collective_table:
        return measured_all_reduce_s(cluster.device.collective_table, payload_bytes, n)
    alpha, beta = link(cluster, crosses, n)
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * payload_bytes / beta


def gather_s(cluster: ClusterSpec, payload_bytes: float, n: int, crosses: bool) -> float:
    """All-gather or reduce-scatter of a tensor of `payload_bytes` (whole) over n ranks."""
    if n == 1:
        return 0.0
    if cluster.device.collective_table:
        return measured_all_reduce_s(cluster.device.collective_table, payload_bytes, n) / 2
    alpha, beta = link(cluster, crosses, n)
    return (n - 1) * alpha + (n - 1) / n * payload_bytes / beta


def all_to_all_s(cluster: ClusterSpec, payload_bytes: float, n: int, crosses: bool) -> float:
    """An all-to-all in which each of n ranks sends `payload_bytes`, S/n to every rank (itself
    included), as pairwise exchange runs it (Thakur, Rabenseifner & Gropp 2005: n - 1 steps
    of S/n): (n-1) alpha + (n-1)/n S / beta, the cost of an all-gather of S. cpu-here measured
    no all-to-all: it is derived the same way, as the all-gather's half of the measured
    all-reduce."""
    return gather_s(cluster, payload_bytes, n, crosses)


def send_s(cluster: ClusterSpec, payload_bytes: float, crosses: bool) -> float:
    alpha, beta = point_link(cluster, crosses)
    return alpha + payload_bytes / beta


def inline_s(cluster: ClusterSpec, n: int, procs: int, shift: bool = False) -> float:
    """What one collective over n ranks that waits between compute (tp's, cp's, ZeRO-3's)
    costs beyond its own time: cpu-here's measured `sync_penalty` (`shift_penalty` for a ring
    shift) for the nearest process count and n; 0 where nothing was measured (GPUs: the skew
    of identical kernels is not modelled)."""
    d = cluster.device
    rows = d.shift_penalty if shift else d.sync_penalty
    if n == 1 or not rows:
        return 0.0
    p = _nearest(rows, procs)
    mine = [row[1:] for row in rows if row[0] == p]  # shift: (seconds,); else (n, seconds)
    if shift:
        return mine[0][0]
    k = _nearest(mine, n)
    return next(t for m, t in mine if m == k)


def all_reduce_wire(payload_bytes: float, n: int) -> float:
    return 2 * (n - 1) / n * payload_bytes if n > 1 else 0.0


def gather_wire(payload_bytes: float, n: int) -> float:
    return (n - 1) / n * payload_bytes if n > 1 else 0.0
