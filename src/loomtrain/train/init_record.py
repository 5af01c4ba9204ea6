"""A model built on the meta device, with a record of every write its construction makes to
a tensor: nn.init's initializers, Tensor.normal_ and kin, factories such as torch.ones, and the
in-place changes after them; train/materialize.py replays them. What it records, and what it
refuses: docs/architecture.md, "Materialization".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

# write every element and read none: a tensor's value is its last one's, then the in-place
# changes after it. (nn.init.trunc_normal_ is not among them: it draws nothing on meta)
_INIT = {getattr(nn.init, n) for n in ("uniform_", "normal_", "constant_", "kaiming_uniform_")}
_INIT |= {getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "zero_", "fill_", "random_",
                                             "exponential_", "cauchy_", "log_normal_",
                                             "geometric_")}
_FACTORIES = {torch.zeros, torch.ones, torch.full, torch.arange, torch.linspace, torch.logspace,
              torch.eye, torch.tensor, torch.rand, torch.randn, torch.randint, torch.randperm,
              torch.normal}
_DRAWS = {nn.init.uniform_, nn.init.normal_, nn.init.kaiming_uniform_, torch.rand, torch.randn,
          torch.randint, torch.randperm, torch.normal} | \
    {getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "random_", "exponential_",
                                        "cauchy_", "log_normal_", "geometric_")}
# random draws shaped by other tensors' values: they cannot be replayed from shapes
_RANDOM = {torch.bernoulli, torch.multinomial, torch.poisson, torch.rand_like, torch.randn_like,
           torch.randint_like, torch.Tensor.bernoulli_, torch.nn.functional.dropout,
           torch.nn.functional.rrelu}
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad"}
_IN_PLACE = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"}


class _Target:
    """Stands for the tensor written in an event's arguments."""

    def __repr__(self) -> str:
        return "<the tensor written>"


_TARGET = _Target()


class NotRecordable(ValueError):
    """The model's construction does something `materialize` could not replay."""


@dataclass
class Event:
    """One write of the construction: `func(*args, **kwargs)`, `_TARGET` in them standing for
    the tensor written; a factory's (`factory`) result is the tensor."""

    func: Callable
    args: tuple
    kwargs: dict
    starts: bool  # it writes every element and reads none: the tensor's value starts here
    factory: bool
    size: torch.Size
    stride: tuple
    dtype: torch.dtype
    key: str | None = None  # the model tensor it writes (its first name); None: a temporary

    @property
    def draws(self) -> bool:
        return self.func in _DRAWS

    @property
    def nbytes(self) -> int:
        return self.size.numel() * self.dtype.itemsize

    def run(self, value: torch.Tensor | None = None) -> torch.Tensor:
        """The write on the CPU, as the eager build made it: on `value`, else on a new tensor."""
        if self.factory:
            return self.func(*self.args, **{**self.kwargs, "device": "cpu"})
        if value is None:
            value = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device="cpu")
        args, kwargs = _pytree.tree_map(lambda x: value if x is _TARGET else x,
                                        (self.args, self.kwargs))
        with torch.no_grad():
            self.func(*args, **kwargs)
        return value


@dataclass
class InitRecord:
    """What `materialize` replays: the construction's writes in order, the model's tensors by
    every name (a tied one has several) and the random state the construction started from."""

    events: list[Event]
    names: dict[str, str]  # every name of a model tensor -> its first name (its key)
    shapes: dict[str, tuple[torch.Size, torch.dtype]]  # key -> the full tensor's
    rng_state: torch.Tensor
    final: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> its value's events
    derived: set[str] = field(default_factory=set)  # buffers their module's init_buffers() makes

    @property
    def model_bytes(self) -> int:
        return sum(s.numel() * d.itemsize for s, d in self.shapes.values())

    @property
    def largest_bytes(self) -> int:
        return max((s.numel() * d.itemsize for s, d in self.shapes.values()), default=0)


class _Recorder(TorchFunctionMode):
    """Records the writes of a construction on the meta device (where nothing is drawn). Inside
    a recorded call the mode is off: nn.init.normal_'s own Tensor.normal_ is not seen again."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[Event, torch.Tensor]] = []  # with the meta tensor written
        self.refused: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        asked = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__get__" and asked == "is_meta":
            # code that asks may do otherwise on meta (nn.init.trunc_normal_ draws nothing there)
            self.refused.append("it asks whether a tensor is on the meta device")
        tensors = [x for x in _pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if func in _RANDOM or func in _FACTORIES and tensors and func in _DRAWS:
            self.refused.append(f"{name} draws random numbers shaped by other tensors")
        elif func in _FACTORIES and not tensors:
            self._add(func, args, kwargs, out, True, True)
        elif func in _INIT or name in _IN_PLACE or "out" in kwargs or \
                name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES:
            target = kwargs.get("out", tensors[0] if tensors else None)
            if target is not None:
                args, kwargs = _pytree.tree_map(lambda x: _TARGET if x is target else x,
                                                (args, kwargs))
                self._add(func, args, kwargs, target, func in _INIT and len(tensors) == 1, False)
        return out

    def _add(self, func, args, kwargs, target, starts: bool, factory: bool) -> None:
        event = Event(func, args, kwargs, starts, factory, target.shape, target.stride(),
                      target.dtype)
        self.events.append((event, target))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _whole(t: torch.Tensor, full: torch.Tensor) -> bool:
    return (t.shape == full.shape and t.stride() == full.stride() and t.dtype == full.dtype
            and t.storage_offset() == full.storage_offset())


def _reads_tensors(e: Event) -> bool:
    return any(isinstance(x, torch.Tensor) for x in _pytree.tree_leaves((e.args, e.kwargs)))


def record_init(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """(the model `build()` returns, built on the meta device; what its construction wrote).
    NotRecordable where `materialize` could not reproduce the eager build's values."""
    rng_state = torch.get_rng_state()
    recorder = _Recorder()
    with torch.device("meta"), recorder:
        model = build()
    kind = type(model).__name__
    if not torch.equal(rng_state, torch.get_rng_state()):  # meta draws nothing
        recorder.refused.append("it draws from (or reseeds) the CPU generator itself")
    if recorder.refused:
        raise NotRecordable(f"cannot build {kind} on the meta device: {recorder.refused[0]}")
    full: dict[int, tuple[str, torch.Tensor]] = {}
    names = {}
    for name, t in (*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)):
        if t.is_meta:
            key, first = full.setdefault(_storage(t), (name, t))
            if not _whole(t, first):
                raise NotRecordable(f"{kind}: {name} and {key} are different views of one tensor")
            names[name] = key
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise NotRecordable(f"{kind}: {path}.{attr} is a tensor neither a parameter nor "
                                    "a buffer: it would stay on the meta device")
    record = InitRecord([e for e, _ in recorder.events], names,
                        {k: (t.shape, t.dtype) for k, t in full.values()}, rng_state)
    _check(model, record, [(e, t, *full.get(_storage(t), (None, None)))
                           for e, t in recorder.events])
    return model, record


def _check(model: nn.Module, record: InitRecord, written: list) -> None:
    """Names the model tensor each write writes and finds the writes of its value: its last
    whole start and the writes after it. Refuses what cannot be replayed."""
    for i, (e, target, key, full) in enumerate(written):
        e.key = key
        if key is not None and e.starts and _whole(target, full):
            record.final[key] = (i, i)
        elif key in record.final:
            record.final[key] = (record.final[key][0], i)
    for i, (e, target, key, full) in enumerate(written):
        if key in record.final and record.final[key][0] <= i and \
                (not _whole(target, full) or not e.starts and _reads_tensors(e)):
            raise NotRecordable(f"{key}: its construction changes it in part, or by "
                                f"{getattr(e.func, '__name__', e.func)} from other tensors")
        if e.draws and not e.starts:
            raise NotRecordable(f"{e.func.__name__} draws random numbers from other tensors")
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    modules = dict(model.named_modules())
    for name, key in record.names.items():
        owner = modules[name.rpartition(".")[0]]
        if key in record.final:
            continue
        if name in buffers and hasattr(owner, "init_buffers"):
            record.derived.add(key)
            continue
        raise NotRecordable(f"{type(model).__name__}: {key} is not initialized in place at "
                            f"construction; give {type(owner).__name__} an init_buffers() that "
                            "computes it")
