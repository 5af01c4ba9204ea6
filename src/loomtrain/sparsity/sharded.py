"""Sparse training in the ZeRO engine (parallel/zero/): the masks cut along its flat shards.

Each rank steps its optimizer range of every unit: slices of the fp32 master weights and of
the reduced gradient (`ShardedOptimizer.slices`), which it masks where the plain path masks
the parameters and their `.grad`. The compute weights every rank keeps at stages 1-2 are the
master's own storage in fp32 and a bf16 copy published from it in bf16: the sparsifier masks
them in place as it does the plain parameters, so masking needs no communication. At stage 3
they are the shards' compute copies, published from the masked master (a local copy). A
decision that reads a whole layer (RigL's regrowth by the gradient; a ranking of the weights
in bf16 or at stage 3, where the fp32 values live only in the shards) all-gathers the units
that hold sparse layers.
Bytes and limits: docs/sparsity.md, "ZeRO and bf16".
"""

from __future__ import annotations

import torch

from loomtrain import comm


class ShardedSlices:
    """This rank's slices of the sparse layers `names` in the engine of `optimizer` (a
    `ShardedOptimizer`): {name: [(start, stop, view)]}, [start, stop) the slice's flat range
    in the layer, `view` the master slice the inner optimizer steps (its `.grad` the reduced
    gradient's slice, its state keyed by it); `shapes`: {name: this rank's shape of the
    layer} (a tensor-parallel piece's), which ZeRO-3's empty parameters do not show."""

    def __init__(self, optimizer, names: list[str]):
        self.optimizer, self.engine = optimizer, optimizer.engine
        self.slices: dict[str, list[tuple]] = {name: [] for name in names}
        for name, _, view, _, piece in optimizer.slices:
            if name in self.slices:
                self.slices[name].append((piece.start, piece.stop, view))
        self.units = [u for u in self.engine.all_units
                      if any(slot.name in self.slices for slot in u.layout.slots)]
        self.shapes = {slot.name: slot.shape for u in self.units for slot in u.layout.slots
                       if slot.name in self.slices}
        plan = self.engine.plan
        # stage 3: the parameters are empty between the forwards that gather them
        self.gathered = any(u.sharded_params for u in self.engine.all_units)
        # whether the parameters every rank keeps are the whole fp32 master weights' own
        # storage (fp32 at stages 1-2), so that masking them masks the master and reading
        # them reads it; otherwise (bf16, stage 3, offload) the master is a tensor apart
        self.local_weights = plan.compute_dtype == torch.float32 and not plan.offload \
            and not self.gathered

    def _slices(self, where: dict[str, torch.Tensor]):
        """(the slice of where[name], view) for every slice of the layers in `where`."""
        for name, whole in where.items():
            flat = whole.flatten()
            for start, stop, view in self.slices[name]:
                yield flat[start:stop].to(view.device), view  # offload: host slices

    @torch.no_grad()
    def zero_masters(self, where: dict[str, torch.Tensor]) -> None:
        """Master weights set to +0 where `where` ({name: bool tensor shaped like this rank's
        layer, or its tp piece}) is True; at stage 3 published into the shards' compute
        copies."""
        for part, view in self._slices(where):
            view.masked_fill_(part, 0.0)
        if self.gathered:
            self.engine.publish()

    @torch.no_grad()
    def zero_gradients(self, where: dict[str, torch.Tensor]) -> None:
        self.engine.ready_grads()
        for part, view in self._slices(where):
            view.grad.masked_fill_(part, 0.0)

    @torch.no_grad()
    def reset_state(self, changed: dict[str, torch.Tensor]) -> None:
        """The inner optimizer's per-weight state zeroed where `changed`, slice by slice (as
        `Sparsifier.reset_optimizer_state` does on whole parameters)."""
        for part, view in self._slices(changed):
            for value in self.optimizer.state.get(view, {}).values():
                if torch.is_tensor(value) and value.shape == part.shape:
                    value.masked_fill_(part, 0.0)

    @torch.no_grad()
    def whole(self, kind: str) -> dict[str, torch.Tensor]:
        """{name: the whole layer} of the fp32 master weights (`kind` "master") or the reduced
        gradient ("grad"): every unit that holds a sparse layer all-gathered from the
        optimizer ranges, as `publish` gathers the parameters: over the replica axis where
        the optimizer range is a part of the shard (hierarchical, optimizer_shard="dp"),
        then over the shard axis."""
        if kind == "grad":
            self.engine.ready_grads()
        plan, out = self.engine.plan, {}
        for u in self.units:
            full = (u.master if kind == "master" else u.grad).to(self.engine.mesh.device)
            if plan.optimizer_over_replicas:
                full = self._gathered(full, plan.replica_axis)
            full = self._gathered(full, plan.shard_axis)
            for slot in u.layout.slots:
                if slot.name in self.slices:
                    out[slot.name] = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        return out

    def _gathered(self, mine: torch.Tensor, axis: str) -> torch.Tensor:
        """Every `axis` rank's `mine`, concatenated in rank order."""
        mesh = self.engine.mesh
        if mesh.size(axis) == 1:
            return mine
        full = mine.new_empty((mesh.size(axis), mine.numel()))
        comm.all_gather(full, mine.contiguous(), mesh, axis)
        return full.flatten()
