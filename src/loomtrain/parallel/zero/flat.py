"""One ZeRO unit's tensors: the flat parameter store, the fp32 master and gradient shards, and
the parameters as views into a gathered buffer.

What each tensor holds at each stage, and how the parameters stay the user's own:
docs/zero.md, "The tensors of one unit".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from loomtrain.parallel.zero.layout import UnitLayout


@dataclass(frozen=True)
class ShardPlan:
    """How one rank shards: which stage, over which mesh axes, in which dtypes."""

    stage: int  # 1, 2, 3 (stage 0 with bf16 runs as stage 1 over the one-rank axis "self")
    shard_axis: str  # "dp", or "dp.local" (hierarchical), or "self"
    replica_axis: str  # "self", or "dp.cross" (hierarchical), or "dp" (stage 0 with bf16)
    shard_ranks: int  # L
    shard_index: int
    replica_ranks: int  # C
    replica_index: int
    optimizer_over_replicas: bool  # optimizer state split over the replica axis too
    compute_dtype: torch.dtype
    offload: bool  # master, gradient and optimizer state in host memory
    host: torch.device

    @property
    def optimizer_ranks(self) -> int:
        return self.shard_ranks * (self.replica_ranks if self.optimizer_over_replicas else 1)

    @property
    def data_axis(self) -> str:
        """The mesh axis of every rank the gradient is summed over (shard and replica ranks)."""
        if self.replica_axis == "self":
            return self.shard_axis
        if self.shard_axis == "self":
            return self.replica_axis  # stage 0 in bf16
        return self.shard_axis.partition(".")[0]  # hierarchical: "dp", or "dpcp" under cp

    @property
    def optimizer_axis(self) -> str:
        """The group over which the optimizer ranges tile the unit (for norms)."""
        if self.optimizer_over_replicas and self.replica_ranks > 1:
            return self.shard_axis.partition(".")[0]  # "dp", or "dpcp" under cp
        return self.shard_axis


def optimizer_range(shard: tuple[int, int], plan: ShardPlan) -> tuple[int, int]:
    """The flat range of a unit whose master weights and optimizer state this rank keeps: its
    shard, or its part of the shard where the optimizer state is split over the replicas too."""
    lo, hi = shard
    if not plan.optimizer_over_replicas:
        return lo, hi
    sub = (hi - lo) // plan.replica_ranks
    return lo + sub * plan.replica_index, lo + sub * (plan.replica_index + 1)


class FlatUnit:
    """The parameters of one unit (a module, or the model's leftover parameters) as one flat buffer."""

    def __init__(self, layout: UnitLayout, params: list[nn.Parameter], module: nn.Module,
                 plan: ShardPlan, device: torch.device):
        self.layout, self.params, self.module, self.plan = layout, params, module, plan
        self.shard = layout.range(plan.shard_index, plan.shard_ranks)
        self.optimizer_range = optimizer_range(self.shard, plan)
        self.sharded_params = plan.stage == 3 and plan.shard_ranks > 1
        dtype = plan.compute_dtype
        with torch.no_grad():
            full = torch.zeros(layout.padded, dtype=torch.float32, device=device)
            for p, slot in zip(params, layout.slots):
                full[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            mine = full[self.shard[0]:self.shard[1]] if self.sharded_params else full
            self.store = mine.to(dtype, copy=True) if (self.sharded_params or dtype != torch.float32) else mine
            o_lo, o_hi = self.optimizer_range
            if dtype != torch.float32 or plan.offload:  # the master weights are a tensor of their own
                self.master = torch.empty(o_hi - o_lo, dtype=torch.float32, device=plan.host,
                                          pin_memory=_pin(plan)).copy_(full[o_lo:o_hi])
            else:
                self.master = self.local(self.optimizer_range)
            del full, mine
        self.acc = (torch.zeros(layout.padded, dtype=torch.float32, device=device)
                    if plan.stage == 1 else None)
        if self.acc is not None and not plan.offload:
            self.grad = self.acc[self.optimizer_range[0]:self.optimizer_range[1]]
        else:
            self.grad = torch.zeros(self.master.shape, dtype=torch.float32, device=plan.host,
                                    pin_memory=_pin(plan))
        self.grad_is_zero = True  # `grad` holds nothing yet: a reduction may write straight into it
        self.full: torch.Tensor | None = None  # stage 3: the gathered unit, while in use
        self._gathered: torch.Tensor | None = None  # its buffer; no storage while released
        self.compute_grad: torch.Tensor | None = None  # this backward's gradient buffer
        self.held: torch.Tensor | None = None  # a pipelined step's unreduced fp32 gradient
        self.cuts = None  # while gradient masks are set: its kept entries' cuts (zero/sparse.py)
        self._empty = torch.empty(0, dtype=dtype, device=device)
        if self.sharded_params:
            self.release()
        else:
            self.point_params_at(self.store)
        # per-backward bookkeeping, reset by the engine
        self.ready = 0
        self.launched = False

    @property
    def store_offset(self) -> int:
        """Flat index of `store[0]` in the unit."""
        return self.shard[0] if self.sharded_params else 0

    def local(self, flat_range: tuple[int, int]) -> torch.Tensor:
        """The part of `store` that holds the unit's flat range (inside my shard for stage 3)."""
        lo, hi = (x - self.store_offset for x in flat_range)
        return self.store[lo:hi]

    def point_params_at(self, full: torch.Tensor) -> None:
        for p, slot in zip(self.params, self.layout.slots):
            p.data = full[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def gather_buffer(self) -> torch.Tensor:
        """Stage 3: the unit's one gathered buffer, its storage (re)allocated to full size."""
        if self._gathered is None:
            self._gathered = torch.empty(self.layout.padded, dtype=self.store.dtype,
                                         device=self.store.device)
        storage = self._gathered.untyped_storage()
        nbytes = self.layout.padded * self._gathered.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self._gathered

    def release(self) -> None:
        """Stage 3: free the gathered buffer; the parameters become empty until the next gather.

        The buffer's storage is resized to nothing rather than dropped (as FSDP does): autograd
        may have saved views of the parameters (`weight.t()` in a linear layer), and a dropped
        buffer would live on in them until backward. The next gather refills the same storage,
        so those views hold the right values again when backward reads them."""
        for p in self.params:
            p.data = self._empty
        if self._gathered is not None:
            self._gathered.untyped_storage().resize_(0)
        self.full = None

    def use_gathered(self, full: torch.Tensor) -> None:
        self.full = full
        self.point_params_at(full)

    def grad_buffer(self) -> torch.Tensor:
        """The buffer this backward collects the unit's gradients into (`.grad` become views of
        it): stage 1 in fp32 accumulates straight into `acc`, whose views `.grad` always are;
        otherwise a fresh buffer in the compute dtype, freed once reduced. The fresh buffer is
        not zeroed: each gradient is copied into its slot when autograd delivers it
        (`take_grad`), so its memory is touched as the backward goes, as autograd's own
        gradients would be, and `collect_grads` zeroes the slots nothing was written to."""
        if self.compute_grad is None:
            if self.acc is not None and self.plan.compute_dtype == torch.float32:
                self.compute_grad = self.acc
                for p, slot in zip(self.params, self.layout.slots):
                    view = self._slot_view(slot)
                    if p.shape != view.shape:
                        continue  # freed (stage 3, a unit that was not gathered): nothing to point at
                    if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)
                    p.grad = view
            else:
                self.compute_grad = torch.empty(self.layout.padded, dtype=self.plan.compute_dtype,
                                                device=self._empty.device)
                self._written = [False] * len(self.params)
                for i, p in enumerate(self.params):
                    if p.grad is not None:  # a gradient autograd already made is moved in
                        self.take_grad(i)
        return self.compute_grad

    def _slot_view(self, slot) -> torch.Tensor:
        return self.compute_grad[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def take_grad(self, i: int) -> None:
        """Parameter i's `.grad` just changed: move it into its slot of the buffer (copied the
        first time, added after) and make `.grad` the slot's view, so that any further
        accumulation in this backward goes straight into the buffer."""
        p, slot = self.params[i], self.layout.slots[i]
        if self.compute_grad is None:
            self.grad_buffer()
        view = self._slot_view(slot)
        if self.compute_grad is self.acc or p.grad is None or p.grad.data_ptr() == view.data_ptr():
            return
        if self._written[i]:
            view.add_(p.grad)
        else:
            view.copy_(p.grad)
            self._written[i] = True
        p.grad = view

    def collect_grads(self) -> torch.Tensor:
        """The unit's gradient of this backward as one flat buffer; a `.grad` the user replaced
        with a fresh tensor is copied in, and slots no gradient reached (unused parameters, the
        padding) are zeroed."""
        buffer = self.grad_buffer()
        fresh = buffer is not self.acc
        for i, (p, slot) in enumerate(zip(self.params, self.layout.slots)):
            view = buffer[slot.offset:slot.offset + slot.numel]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            elif fresh and not self._written[i]:
                view.zero_()
        if fresh:
            end = max((s.offset + s.numel for s in self.layout.slots), default=0)
            buffer[end:].zero_()
        return buffer

    def hold(self, buffer: torch.Tensor) -> None:
        """Add one micro-batch's gradient (`collect_grads`) into the step's unreduced sum
        (stages 2-3 under a pipeline: reduced once, at the end of the step); the first fp32
        buffer is kept as the sum itself."""
        if self.held is None:
            self.held = buffer if buffer.dtype == torch.float32 else buffer.float()
        else:
            self.held.add_(buffer)

    def unreduced_grad(self, i: int) -> torch.Tensor | None:
        """Parameter i's gradient summed over the micro-batches so far, unreduced: its slot of
        the step's fp32 sum (`held`, or stage 1's `acc`) with any gradient made since the last
        launch (a deferred weight gradient, zero-bubble's W) folded in; `.grad` without one."""
        p, slot = self.params[i], self.layout.slots[i]
        total = self.held if self.held is not None else self.acc
        if total is None:
            return p.grad
        view = total[slot.offset:slot.offset + slot.numel].view(slot.shape)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.add_(p.grad)
            p.grad = None
        return view

    def drop_grads(self) -> None:
        """Forget this backward's buffer (its reduction holds it until done); stage 1 in fp32
        keeps `.grad` as views of `acc`."""
        if self.compute_grad is self.acc:
            return
        self.compute_grad = None
        for p in self.params:
            p.grad = None

    def accumulate(self, reduced: torch.Tensor) -> None:
        """Add a reduced gradient of my optimizer range into `grad` (nothing to do when the
        reduction happened in place in `grad` itself)."""
        if reduced.data_ptr() != self.grad.data_ptr():
            self.ready_grad().add_(reduced.to(self.grad.device))
        self.grad_is_zero = False

    @property
    def grad_freeable(self) -> bool:
        """Whether `grad` is a tensor of its own in device memory (stages 2-3, stage 1 in bf16),
        not a view of the stage-1 accumulator or a host buffer kept for offload."""
        return self.acc is None and not self.plan.offload

    def free_grad(self) -> None:
        """Give the gradient shard's memory back between steps, as torch's optimizers drop
        `.grad` at zero_grad(set_to_none=True) (FSDP2's sharded gradients too): its storage
        shrinks to nothing, so the views the optimizer's slices hold stay valid, and
        `ready_grad` brings it back (measured on benchmarks/llama.py's ZeRO-3: 64 MiB per rank
        between steps). Elsewhere it is zeroed in place."""
        if self.grad_freeable:
            self.grad.untyped_storage().resize_(0)
        else:
            self.grad.zero_()
        self.grad_is_zero = True

    def ready_grad(self, zeroed: bool = True) -> torch.Tensor:
        """`grad`, its memory back if `free_grad` gave it away: zeroed, unless the caller
        overwrites every element (`zeroed=False`)."""
        storage = self.grad.untyped_storage()
        nbytes = self.grad.numel() * self.grad.element_size()
        if storage.nbytes() < nbytes:
            storage.resize_(nbytes)
            if zeroed:
                self.grad.zero_()
        return self.grad


def _pin(plan: ShardPlan) -> bool:
    """Pinned host memory makes host<->GPU copies faster; it needs CUDA."""
    return plan.offload and plan.host.type == "cpu" and torch.cuda.is_available()
