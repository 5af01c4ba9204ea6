"""The [parallel] section's mesh keys and the data-parallel component (parallel/data.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomtrain.component import REPLICATE, Built, Component, Section


class MeshKeys(Section):
    nproc: int = Field(2, ge=1)
    dp: int | None = Field(None, ge=1)  # None: whatever nproc leaves after tp, pp and cp
    ranks_per_node: int | None = Field(None, ge=1)  # None: all ranks on one node
    bucket_mb: float = Field(25.0, gt=0.0)
    timeout_s: float = Field(300.0, gt=0.0)
    # a rank whose heartbeat is this old is named as stalled, and the job ends (0: no heartbeat)
    heartbeat_timeout_s: float = Field(30.0, ge=0.0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @property
    def dp_size(self) -> int:
        return self.dp if self.dp is not None else self.nproc // (self.tp * self.pp * self.cp)


class DataParallelComponent(Component):
    """Data parallelism over dp: always on; the mesh (dp * tp * pp * cp = nproc) and nodes."""

    name = "data_parallel"
    section, keys = "parallel", MeshKeys
    summary = "bucketed gradient all-reduce over dp (parallel/data.py)"
    stage = REPLICATE + 2  # the replica engine when no other took the dp axis

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.parallel.data import apply_data_parallel

        from loomtrain.parallel.state import PLAIN

        if built.replicated:
            return
        built.model = apply_data_parallel(built.model, built.mesh, built.cfg.parallel,
                                          built.compressor)
        built.replicated, built.parts[cls.name] = True, built.model
        built.layout = PLAIN

    @classmethod
    def estimate(cls, plan) -> None:
        """The real engine's gradient buckets, all-reduced over dp once per step."""
        from loomtrain.estimate import all_reduce, gradient_all_reduces
        from loomtrain.parallel.data import apply_data_parallel

        if plan.replicated:
            return
        p = plan.cfg.parallel
        engine = apply_data_parallel(plan.model, plan.mesh, p)
        plan.bucket_bytes = [b.buffer.numel() * b.buffer.element_size() for b in engine.buckets]
        plan.reductions = gradient_all_reduces(plan.bucket_bytes, p.dp_size * p.cp, engine.axis)
        if any(b.axis != engine.axis for b in engine.buckets):  # experts' buckets: over edp
            plan.reductions = [all_reduce(r.purpose, b.axis, plan.mesh.size(b.axis),
                                          r.payload_bytes)
                               for r, b in zip(plan.reductions, engine.buckets)
                               if plan.mesh.size(b.axis) > 1]
        if plan.mesh.size("ep") > 1:  # clip_replica_grads: each ep rank holds other experts
            plan.reductions.append(all_reduce("gradient norm over ep", "ep",
                                              plan.mesh.size("ep"), 4))
        plan.replicated = True

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        """The engine's compression and sparse-communication figures (none without them)."""
        return built.model.metrics() if cls.name in built.parts else {}

    @classmethod
    def validate(cls, cfg) -> None:
        p = cfg.parallel
        mesh_size = p.dp_size * p.tp * p.pp * p.cp
        if mesh_size != p.nproc or p.dp_size < 1:
            raise ValueError(
                f"the mesh dp*tp*pp*cp = {p.dp_size}*{p.tp}*{p.pp}*{p.cp} = {mesh_size} must equal "
                f"parallel.nproc={p.nproc}")
        if 0 < p.heartbeat_timeout_s < 1:
            raise ValueError(
                f"parallel.heartbeat_timeout_s={p.heartbeat_timeout_s:g} is too short to tell a "
                f"stall from a busy rank: give 0 (no heartbeat) or at least 1 (seconds)")
        if p.ranks_per_node is not None and p.nproc % p.ranks_per_node:
            raise ValueError(
                f"parallel.ranks_per_node={p.ranks_per_node} must divide parallel.nproc={p.nproc}")
