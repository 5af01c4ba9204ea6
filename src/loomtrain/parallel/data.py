"""The data-parallel engine, ZeRO stage 0: replicated parameters, bucketed gradient all-reduce
(the scheme of PyTorch DDP, Li et al., VLDB 2020).

Buckets are all-reduced asynchronously during backward, or compressed (docs/compression.md),
or reduced on their masked entries only (docs/sparsity.md). The step, mean or sum, and the
bytes: docs/data-parallel.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loomtrain import comm
from loomtrain.comm.compress import relative_error
from loomtrain.comm.mask_sync import broadcast_masks
from loomtrain.parallel.placement import dp_axis_of, split_over_tp
from loomtrain.parallel.sparse_dp import SparseCommWindow, bucket_keeps, check_masks

# The hook that runs at the end of backward: the same engine callback DDP and FSDP use.
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


@dataclass
class Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    ready: int = 0
    pending: comm.Pending | None = None
    launched: bool = False
    keep: torch.Tensor | None = None  # sparse-aware DP: the buffer entries that travel
    compact: torch.Tensor | None = None  # ... gathered, in flight
    axis: str = "dp"  # the ranks it is all-reduced over (an expert's weights: "edp")


def build_buckets(params: list[nn.Parameter], bucket_bytes: int,
                  last_bucket_bytes: int = 0, axis: str = "dp") -> list[Bucket]:
    """Greedy buckets of at most `bucket_bytes` (a larger parameter gets a bucket of its own),
    one dtype, device and reduce axis (`dp_axis_of` in `axis`) per bucket, in the order given.
    With `last_bucket_bytes`, the parameters at the end of the order that fit in it are
    bucketed apart, in buckets of at most that size."""
    tail, size = len(params), 0
    while tail > 0 and size + _nbytes(params[tail - 1]) <= last_bucket_bytes:
        tail -= 1
        size += _nbytes(params[tail])
    groups = _greedy_groups(params[:tail], bucket_bytes)
    groups += _greedy_groups(params[tail:], last_bucket_bytes)
    buckets = []
    for group in groups:
        buffer = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype,
                             device=group[0].device)
        views, offset = [], 0
        for p in group:
            views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        buckets.append(Bucket(group, buffer, views, axis=dp_axis_of(group[0], axis)))
    return buckets


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _greedy_groups(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = _nbytes(p)
        same_kind = groups and _kind(groups[-1][0]) == _kind(p)
        if not groups or not same_kind or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


def _kind(p: nn.Parameter) -> tuple:
    return p.dtype, p.device, getattr(p, "dp_axis", None)


def broadcast_state(module: nn.Module, mesh, axis: str, chunk_mb: float = 32.0) -> None:
    """Parameters and buffers from the axis member 0 to all, so replicas start identical
    whatever their seeds (`broadcast_tensors`); a tensor replicated over a sub-axis only (an
    expert's weights) over that sub-axis."""
    tensors = [t for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    for sub in dict.fromkeys(dp_axis_of(t, axis) for t in tensors):
        broadcast_tensors([t for t in tensors if dp_axis_of(t, axis) == sub], mesh, sub,
                          chunk_mb=chunk_mb)


def broadcast_tensors(tensors: list[torch.Tensor], mesh, axis: str, src_local: int = 0,
                      chunk_mb: float = 32.0) -> None:
    """`tensors` from the axis member `src_local` into every member's own (same shapes and
    dtypes, in the same order): one flat broadcast per dtype and chunk of at most `chunk_mb`
    (a larger tensor goes alone, without a copy), so it needs the tensors plus one chunk, not
    two copies of them."""
    limit = int(chunk_mb * 2**20)
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = list({id(t): t for t in tensors if t.dtype == dtype}.values())
        chunk, size = [], 0
        for t in same + [None]:
            nbytes = 0 if t is None else t.numel() * t.element_size()
            if chunk and (t is None or size + nbytes > limit):
                _broadcast_chunk(chunk, mesh, axis, src_local)
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += nbytes


def _broadcast_chunk(same: list[torch.Tensor], mesh, axis: str, src_local: int) -> None:
    if len(same) == 1 and same[0].is_contiguous():
        comm.broadcast(same[0].detach(), mesh, axis, src_local)
        return
    flat = _flatten_dense_tensors([t.detach() for t in same])
    comm.broadcast(flat, mesh, axis, src_local)
    with torch.no_grad():
        for t, src in zip(same, _unflatten_dense_tensors(flat, same)):
            t.copy_(src)


GRADIENT_REDUCES = ("mean", "sum")


def check_gradient_reduce(gradient_reduce: str) -> None:
    """ValueError unless `gradient_reduce` is one of `GRADIENT_REDUCES` (the dp engines'
    shared option: DataParallel and ZeRO's `shard`)."""
    if gradient_reduce not in GRADIENT_REDUCES:
        raise ValueError(
            f"gradient_reduce={gradient_reduce!r} is not one of "
            f"{', '.join(repr(r) for r in GRADIENT_REDUCES)}: \"mean\" averages the gradients "
            "over the data-parallel ranks, as torch DDP and FSDP2 do (for a loss averaged over "
            "each rank's own batch); \"sum\" adds them (for a loss already divided by the "
            "global token count, as loomtrain's trainer computes it)")


def norm_weight(p: torch.Tensor, mesh) -> float:
    """What the square of `p`'s gradient counts for in the global norm, on each rank holding
    it: a tensor-parallel piece counts whole, a tensor replicated over tp (an expert's slice
    too) for 1/tp; a parameter held by several pipeline stages (a tied embedding) for
    1/`pp_copies`."""
    weight = 1.0 if split_over_tp(p) else 1.0 / mesh.size("tp")
    return weight / getattr(p, "pp_copies", 1)


def grad_norm(groups: list[tuple[list[torch.Tensor], float]], mesh, axis: str) -> torch.Tensor:
    """The global 2-norm of a gradient held in pieces: `groups` pairs gradient tensors with
    the weight of their squares (`norm_weight`). `axis` is the group whose ranks hold
    different pieces of the same tensors (ZeRO's shard axis; "self" when every dp rank holds
    all of them); tp and pp ranks hold different pieces too. One number is all-reduced over
    each of `axis`, tp and pp (sizes of 1 cost nothing)."""
    square = torch.zeros((), dtype=torch.float32, device=mesh.device)
    for grads, weight in groups:
        if grads:
            norms = torch.stack(torch._foreach_norm(grads)).float().to(mesh.device)
            square = square + norms.square().sum() * weight
    for group in (axis, "tp", "pp"):
        comm.all_reduce(square, mesh, group)
    return square.sqrt()


def weighted_groups(items, mesh) -> list[tuple[list[torch.Tensor], float]]:
    """[(gradients, weight), ...] from (parameter, gradient) pairs, grouped by `norm_weight`."""
    groups: dict[float, list[torch.Tensor]] = {}
    for p, g in items:
        groups.setdefault(norm_weight(p, mesh), []).append(g)
    return list((grads, w) for w, grads in groups.items())


def clip_replica_grads(params: list[nn.Parameter], max_norm: float, mesh) -> torch.Tensor:
    """Clip the gradients of one replica's `params` (max_norm 0: only measure); returns the
    norm before clipping, of the whole replica's gradient: its tp and pp ranks each hold
    pieces of it (`grad_norm`), a dp rank holds all of its own replica's but the experts
    its ep peers hold (their squares are summed over "ep", the others' counted 1/ep there)."""
    ep = mesh.size("ep")
    if mesh.size("tp") == 1 and mesh.size("pp") == 1 and ep == 1:
        if max_norm > 0:
            return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return nn.utils.get_total_norm([p.grad for p in params if p.grad is not None],
                                       foreach=True)
    held = [p for p in params if p.grad is not None]
    shared = ((p, p.grad) for p in held if dp_axis_of(p, "dp") == "dp")
    groups = [(g, w / ep) for g, w in weighted_groups(shared, mesh)]
    groups += weighted_groups(((p, p.grad) for p in held if dp_axis_of(p, "dp") != "dp"), mesh)
    total = grad_norm(groups, mesh, "ep")
    if max_norm > 0:
        nn.utils.clip_grads_with_norm_(held, max_norm, total, foreach=True)
    return total


class DataParallel(nn.Module):
    """`model = DataParallel(model, mesh)`; then `loss.backward(); optimizer.step()` as usual.

    The wrapped module is `.module` (its state_dict keys are unchanged there).
    `gradient_reduce`: "mean" (the default, DDP's gradient) or "sum" (`check_gradient_reduce`).
    """

    def __init__(self, module: nn.Module, mesh, axis: str = "dp", bucket_mb: float = 25.0,
                 gradient_reduce: str = "mean", last_bucket_mb: float = 1.0, compressor=None):
        super().__init__()
        check_gradient_reduce(gradient_reduce)
        self.module, self.mesh, self.axis = module, mesh, axis
        self.gradient_reduce = gradient_reduce
        self.compressor = compressor
        self._measure = False  # this step: keep the dense buckets for the error diagnostic
        self._dense: dict[int, torch.Tensor] = {}
        self._window = CompressionWindow()
        self._sparse: SparseCommWindow | None = None  # while gradient masks are set
        self._sync = True
        self._callback_queued = False
        broadcast_state(module, mesh, axis)
        params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
        # a small last bucket shortens the wait after backward: for the default GPT on 2 CPU
        # ranks (gloo), 0.38 MiB instead of 3.39 MiB halved it (docs/benchmarks.md); DDP's
        # rebuilt buckets for that model end with the same 0.38 MiB
        self.buckets = build_buckets(params[::-1], int(bucket_mb * 2**20),
                                     int(min(last_bucket_mb, bucket_mb) * 2**20), axis)
        self._where: dict[nn.Parameter, tuple[Bucket, int]] = {}
        self._index = {id(bucket): i for i, bucket in enumerate(self.buckets)}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._where[p] = (bucket, i)
                p.grad = bucket.views[i]
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-steps before the last): no communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the (already reduced, replicated) gradients; returns the total norm before
        clipping (of the whole model's gradient, also when tensor parallelism split it)."""
        return clip_replica_grads([p for b in self.buckets for p in b.params], max_norm, self.mesh)

    def sync_gradients(self) -> None:
        """Reduce the gradients accumulated under `no_sync()` now, outside any backward (the
        pipeline runtime's end of step: its backward passes run stage by stage)."""
        self._finish()

    def set_gradient_masks(self, masks: dict[nn.Parameter, torch.Tensor] | None) -> None:
        """Communicate only the gradient entries `masks` keep (True), from the next backward
        on; masked-out entries of the reduced gradient are zero. None: the dense path again.

        Collective over the axis, outside backward: every rank calls it at the same point,
        once per mask change (each call is one mask sync, comm/mask_sync.py). The axis
        member 0's masks are the ones used, on every rank, and are copied into the tensors
        the other ranks passed (in place), so ranks that computed their masks separately
        hold member 0's afterwards. A parameter member 0 masks and another rank does not is
        masked there too (nothing to copy into). Bytes: parallel/sparse_dp.py.
        ValueError: a mask that is not a bool tensor shaped like a parameter this engine
        reduces, or masks with a compressor (both sparsify the same all-reduce)."""
        if masks and self.compressor is not None:
            raise ValueError("gradient masks (sparse-aware data parallel) cannot be combined "
                             "with gradient compression: both replace the same bucket "
                             "all-reduce; use one of them")
        assert not any(b.launched for b in self.buckets), "set_gradient_masks inside backward"
        params = [p for b in self.buckets for p in b.params]
        mine = check_masks(masks, params)
        synced, sent = broadcast_masks(mine, params, self.mesh, self.axis)
        with torch.no_grad():
            for given, used in zip(mine, synced):
                if given is not None and used is not None and given is not used:
                    given.copy_(used)
        for bucket, keep in zip(self.buckets, bucket_keeps(self.buckets, synced)):
            bucket.keep = keep
        masked = any(m is not None for m in synced)
        self._sparse = (self._sparse or SparseCommWindow()) if masked else None
        if masked:
            self._sparse.mask_sync_wire += sent

    @property
    def gradient_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            _queue_callback(self._finish)
        bucket, _ = self._where[p]
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        for bucket in self.buckets:
            if bucket.launched:
                continue
            if bucket.ready < len(bucket.params) and not force:
                return  # later buckets wait: launch order must match on every rank
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        n = self.mesh.size(bucket.axis)
        # the mean of a dense bucket is taken as its gradients are copied in (DDP's fused
        # copy: one pass over a copied gradient instead of two; 15 ms a step of the 33.6M
        # llama's 1.1 s, benchmarks/llama.py), the same division, so the same bits
        fuse = self.gradient_reduce == "mean" and bucket.keep is None and self.compressor is None
        in_place = []
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()  # unused in this backward: contributes nothing
            elif p.grad.data_ptr() == view.data_ptr():
                in_place.append(view)
            elif fuse:  # the user set grads to None: copied into the bucket, divided on the way
                torch.div(p.grad, n, out=view)
            else:
                view.copy_(p.grad)
        values = bucket.buffer
        if bucket.keep is not None:  # sparse-aware: the kept entries only
            values = bucket.compact = bucket.buffer.masked_select(bucket.keep)
        if self._sparse is not None:
            self._sparse.add(_nbytes(values), _nbytes(bucket.buffer), n)
        if fuse and len(in_place) < len(bucket.params):  # the others are divided already
            if in_place:
                torch._foreach_div_(in_place, n)
        elif self.gradient_reduce == "mean":
            values.div_(n)
        if self.compressor is None:
            bucket.pending = comm.all_reduce(values, self.mesh, bucket.axis, async_op=True)
        else:  # each bucket over its own axis, its error feedback kept under its index
            index = self._index[id(bucket)]
            if self._measure:
                self._dense[index] = bucket.buffer.clone()
            bucket.pending = self.compressor.start(index, bucket.buffer,
                                                   [p.shape for p in bucket.params],
                                                   self.mesh, bucket.axis)
        bucket.launched = True

    def _finish(self) -> None:
        """End of backward: launch what is left, wait for everything, point grads at buckets."""
        self._launch_ready(force=True)
        for bucket in self.buckets:
            stats = bucket.pending.wait()
            if self.compressor is not None:
                self._window.add(stats)
            if bucket.keep is not None:
                bucket.buffer.zero_().masked_scatter_(bucket.keep, bucket.compact)
                bucket.compact = None
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
            bucket.ready, bucket.pending, bucket.launched = 0, None, False
        self._callback_queued = False
        if self._dense:
            self._measure_error()

    # --- compression: the error diagnostic and the per-step figures ---
    def measure_error(self) -> None:
        """Measure the compressed sum's error against the dense sum in the next reduction."""
        self._measure = self.compressor is not None

    @torch.no_grad()
    def _measure_error(self) -> None:
        """The compressed buckets' sums against their dense sums, each over its own axis."""
        exact, compressed = [], []
        for axis in dict.fromkeys(self.buckets[i].axis for i in sorted(self._dense)):
            mine = [i for i in sorted(self._dense) if self.buckets[i].axis == axis]
            flat = torch.cat([self._dense[i] for i in mine])
            comm.all_reduce(flat, self.mesh, axis, diagnostic=True)
            exact.append(flat)
            compressed += [self.buckets[i].buffer for i in mine]
        self._window.error = relative_error(torch.cat(compressed), torch.cat(exact))
        self._dense, self._measure = {}, False

    def metrics(self) -> dict:
        """The compression figures since the previous call (without a compressor: none), and
        while gradient masks are set the sparse-aware ones (`SparseCommWindow.take`)."""
        rec = {} if self.compressor is None else self._window.take()
        if self._sparse is not None:
            rec.update(self._sparse.take())
        return rec


@dataclass
class CompressionWindow:
    """Compression figures summed over the exchanges since the last record: the ratio (the
    dense ring all-reduce's wire bytes over what was sent), the bytes sent, the mean over the
    exchanges of this rank's local error ||x - D(C(x))|| / ||x||, and the last measured error
    of the compressed sum against the dense sum (None when not measured)."""

    dense_wire: int = 0
    wire: int = 0
    exchanges: int = 0
    local_error: float | torch.Tensor = 0.0  # a tensor sum: read at take(), not per step
    error: float | None = None

    def add(self, stats: dict) -> None:
        self.exchanges += 1
        self.wire += stats["wire_bytes"]
        self.dense_wire += round(stats["ratio"] * stats["wire_bytes"])
        self.local_error += stats["local_error"]

    def take(self) -> dict:
        """{compression_ratio, compression_wire_bytes, compression_local_error and, when it
        was measured, compression_error}; resets the window."""
        rec = {"compression_ratio": round(self.dense_wire / self.wire, 3) if self.wire else None,
               "compression_wire_bytes": self.wire,
               "compression_local_error": (round(float(self.local_error) / self.exchanges, 6)
                                           if self.exchanges else None)}
        if self.error is not None:
            rec["compression_error"] = round(self.error, 6)
        self.__init__()
        return rec


def apply_data_parallel(model: nn.Module, mesh, cfg, compressor=None) -> DataParallel:
    """The dp-axis strategy: `cfg` is the ParallelConfig (bucket_mb). Gradients are summed,
    not averaged (the library default): the trainer divides the loss by the global token
    count, so the sum is the single-process gradient. With cp > 1 over dp and cp
    together: context-parallel peers hold the same replica, each with the gradient of its
    own tokens. `compressor`: compress each bucket (comm/compress/)."""
    axis = "dpcp" if cfg.cp > 1 else "dp"  # the same group at cp = 1; bytes counted as dp
    return DataParallel(model, mesh, axis, cfg.bucket_mb, gradient_reduce="sum",
                        compressor=compressor)


__all__ = ["GRADIENT_REDUCES", "Bucket", "CompressionWindow", "DataParallel", "apply_data_parallel",
           "broadcast_state", "build_buckets", "check_gradient_reduce", "clip_replica_grads",
           "grad_norm", "norm_weight", "weighted_groups"]
