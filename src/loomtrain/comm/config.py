"""The [comm] section: the simulated inter-node link (link.py) and the sparse all-reduce's
scheme (sparse.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomtrain.component import Component, Section, Switch


class CommConfig(Section):
    # a simulated slow link between the nodes of parallel.ranks_per_node (comm/link.py):
    # each rank's bandwidth to other nodes in Gbit/s (None: no simulation), and the latency
    # every cross-node op pays once
    inter_node_gbps: float | None = Field(None, gt=0.0)
    inter_node_latency_ms: float = Field(0.0, ge=0.0)
    # [[after_s, gbps], ...]: the bandwidth becomes gbps after_s seconds after the link was
    # made (each rank's, as it joins the world), in strictly increasing after_s; empty: fixed
    link_changes: list[tuple[float, float]] = []
    # how a sparse tensor (a top-k payload) is summed over ranks (comm/sparse.py): an
    # all-gather of (index, value) pairs, Zen's hash-balanced partition, or the cheaper of
    # the two by their cost formulas
    sparse_allreduce: Literal["auto", "allgather", "balanced"] = "auto"


class SimulatedLink(Component):
    """The simulated link joins nodes: it needs more than one, and its latency needs it."""

    name = "link"
    section, keys = "comm", CommConfig
    switches = (Switch("comm.inter_node_gbps", None),)
    summary = "a simulated slow link between nodes (bandwidth, latency, changes over time)"

    @classmethod
    def validate(cls, cfg) -> None:
        c, p = cfg.comm, cfg.parallel
        if c.inter_node_gbps is None:
            if c.inter_node_latency_ms:
                raise ValueError(f"comm.inter_node_latency_ms={c.inter_node_latency_ms} belongs to "
                                 "the simulated inter-node link, which is off: set "
                                 "comm.inter_node_gbps")
            if c.link_changes:
                raise ValueError(f"comm.link_changes={[list(x) for x in c.link_changes]} changes "
                                 "the simulated inter-node link, which is off: set "
                                 "comm.inter_node_gbps")
            return
        times = [after for after, _ in c.link_changes]
        if any(not after > 0 or not gbps > 0 for after, gbps in c.link_changes) \
                or times != sorted(set(times)):
            raise ValueError(f"comm.link_changes={[list(x) for x in c.link_changes]}: each entry "
                             "is [after_s, gbps], seconds since the link was made (> 0, strictly "
                             "increasing) and the new bandwidth in Gbit/s (> 0)")
        if p.ranks_per_node is None or p.ranks_per_node >= p.nproc:
            rpn = "unset" if p.ranks_per_node is None else p.ranks_per_node
            raise ValueError(f"comm.inter_node_gbps={c.inter_node_gbps} simulates the link between "
                             f"nodes, but parallel.ranks_per_node={rpn} puts all parallel.nproc="
                             f"{p.nproc} ranks on one node: set parallel.ranks_per_node to a "
                             "divisor of nproc below it, or leave comm.inter_node_gbps unset")
