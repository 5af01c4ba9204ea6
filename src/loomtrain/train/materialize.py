"""The model built on the meta device (train/init_record.py), made real per rank after the
split (issue 25, point 6): the construction's writes are replayed in order from its random
state, one full tensor at a time on the CPU, and this rank keeps its pieces (placements:
parallel/placement.py), bitwise those of the eager build then split. The set-up peak, for the
dry run. docs/architecture.md, "Materialization".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from loomtrain.parallel.placement import Placement, placement_of
from loomtrain.train.init_record import InitRecord, record_init


def materialize(model: nn.Module, record: InitRecord, device) -> int:
    """Make the meta tensors of `model` (the model `record_init` built, split or not) real on
    `device`, with the values of the eager build (its construction on the CPU from the
    recorded random state, then `.to(device)` and the split), in place: every Parameter keeps
    its identity (ties, placements, references held by the split). The random state is left
    where the eager construction leaves it. Returns the set-up peak (`setup_peak_bytes`)."""
    torch.set_rng_state(record.rng_state)
    return _replay(model, record, torch.device(device), run=True)


def setup_peak_bytes(model: nn.Module, record: InitRecord, device="cpu") -> int:
    """The most bytes of model tensors `materialize(model, record, device)` holds at once: the
    pieces made so far, the full tensor being drawn (one at a time, on the CPU) and the piece
    cut from it. Computed from shapes: `model` may stay on meta (the dry run)."""
    return _replay(model, record, torch.device(device), run=False)


def _replay(model: nn.Module, record: InitRecord, device: torch.device, run: bool) -> int:
    holders, derived = _holders(model, record)
    live: dict[str, torch.Tensor | None] = {}
    held = live_bytes = peak = 0
    for t in (*model.parameters(), *model.buffers()):
        if not t.is_meta:  # made on a device of its own: moved as the eager build's .to(device)
            held += t.numel() * t.element_size()
            if run and t.device != device:
                _swap(t, t.detach().to(device))
    for i, e in enumerate(record.events):
        start, end = record.final.get(e.key, (-1, -1))
        if e.key not in holders or not start <= i <= end:
            if e.draws:  # its numbers are drawn (the stream stays the eager one's), then dropped
                peak = max(peak, held + live_bytes + e.nbytes)
                if run:
                    e.run()
            continue
        if i == start:
            live_bytes += e.nbytes
            peak = max(peak, held + live_bytes)
        live[e.key] = e.run(live.get(e.key)) if run else None
        if i < end:
            continue
        value = live.pop(e.key)
        for n, (tensor, placement) in enumerate(holders[e.key]):
            nbytes = tensor.numel() * tensor.element_size()
            whole = n == 0 and placement is None and device.type == "cpu"  # the full tensor itself
            if not whole:  # a copy, beside the full tensor
                peak = max(peak, held + live_bytes + nbytes)
            held += nbytes
            if run:
                piece = value if whole else _piece(value, tensor, placement).to(device)
                _swap(tensor, piece.clone() if piece is value and not whole else piece)
        live_bytes -= e.nbytes
    for module, names in derived:
        for name in names:
            held += module._buffers[name].numel() * module._buffers[name].element_size()
            if run:
                _swap(module._buffers[name], torch.empty_like(module._buffers[name], device=device))
        if run:
            module.init_buffers()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    assert not (run and left), f"left on the meta device: {left}"
    return max(peak, held)


def _holders(model: nn.Module, record: InitRecord):
    """({key: [(this rank's meta tensor of it, its placement or None)]}, [(module, the names of
    its derived buffers)]): the tensors `model` holds, by the full tensor they are part of."""
    holders: dict[str, list] = {}
    seen: set[int] = set()
    derived: dict[nn.Module, list[str]] = {}
    modules = dict(model.named_modules())
    for name, t in (*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)):
        if not t.is_meta or id(t) in seen:
            continue
        seen.add(id(t))
        key = record.names.get(name)
        if key is None:
            raise ValueError(f"{name} is not a tensor of the model as built: a split must keep "
                             "the full model's names (the checkpoints' layout-independent form)")
        placement = placement_of(t)
        shape = placement.shape if placement is not None else tuple(t.shape)
        if tuple(record.shapes[key][0]) != tuple(shape):
            raise ValueError(f"{name}: {tuple(shape)} is not the shape of {key}, "
                             f"{tuple(record.shapes[key][0])}")
        if key in record.derived:
            path, _, attr = name.rpartition(".")
            derived.setdefault(modules[path], []).append(attr)
        else:
            holders.setdefault(key, []).append((t, placement))
    return holders, list(derived.items())


def _piece(full: torch.Tensor, local: torch.Tensor, placement: Placement | None) -> torch.Tensor:
    """The entries of `full` the tensor-parallel piece `local` holds (`_piece` in
    parallel/tensor_layers.py), its padding zeros."""
    if placement is None:
        return full
    return placement.take(full, local.shape[placement.dim])


def _swap(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """`tensor` (a meta Parameter or buffer) becomes `value`, keeping its identity and its
    attributes (swap_tensors swaps them too: `value`'s are set to them first)."""
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
    value.__dict__.update(tensor.__dict__)
    torch.utils.swap_tensors(tensor, value)


# --- the dry run's estimate ------------------------------------------------------------------


@dataclass(frozen=True)
class SetupPeak:
    model_bytes: int  # the whole model's tensors
    largest_bytes: int  # its largest tensor's
    rank_bytes: int  # rank 0's pieces'
    peak_bytes: int  # the most rank 0 holds at once while building


def setup_peak(cfg) -> SetupPeak:
    """Rank 0's set-up figures for `cfg` as `build_run` builds: its tp pieces and pp stages cut
    on the meta device, over a fake world of parallel.nproc ranks (no process group may be
    initialized), then materialized. Balanced by time, the stages are timed on the whole
    (tp-split) model, which is materialized first; train.init_from loads the whole model."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loomtrain.mesh import build_mesh
    from loomtrain.parallel import apply_tensor_parallel
    from loomtrain.parallel.pipeline.estimate import split_on_meta
    from loomtrain.train.task import build_task_model

    p = cfg.parallel
    model, record = record_init(lambda: build_task_model(cfg))
    if cfg.train.init_from is not None:
        return SetupPeak(record.model_bytes, record.largest_bytes, record.model_bytes,
                         record.model_bytes)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.nproc)
    try:
        mesh = build_mesh({"pp": p.pp, "dp": p.dp_size, "cp": p.cp, "tp": p.tp, "ep": p.ep},
                          ranks_per_node=p.ranks_per_node, device="cpu")
        model, _ = apply_tensor_parallel(model, mesh, cfg)
        if p.pp > 1 and (p.pipeline_balance != "time" or p.split_points):
            model, _ = split_on_meta(model, mesh, cfg)
    finally:
        dist.destroy_process_group()
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return SetupPeak(record.model_bytes, record.largest_bytes, held,
                     setup_peak_bytes(model, record))
