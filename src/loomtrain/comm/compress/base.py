"""The compressor interface: compress one gradient bucket, exchange it, keep error feedback.

Error feedback (Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al., arXiv
1901.09847): what a compressor drops stays in a residual and is sent later. Buckets, keys,
exactness and the subclass hooks: docs/compression.md, "Reference: the compressors".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loomtrain.comm.meter import wire_bytes


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (2-norms over all elements), 0.0 when exact is zero."""
    norm = torch.linalg.vector_norm(exact.float()).item()
    if norm == 0.0:
        return 0.0
    return torch.linalg.vector_norm((approx - exact).float()).item() / norm


def ring_wire_bytes(nbytes: int, n: int) -> int:
    """What one rank sends in a ring all-reduce of `nbytes` over `n` ranks (comm/meter.py)."""
    return wire_bytes("ring_all_reduce", nbytes, n)


def gather_wire_bytes(gathered_nbytes: int, n: int) -> int:
    """What one rank sends in an all-gather whose output holds `gathered_nbytes`."""
    return wire_bytes("ring_all_gather", gathered_nbytes, n)


def local_relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """`relative_error` as a 0-d tensor on the tensors' device, with no host synchronization:
    it is computed for every exchange, on the backward's hot path, and read only when a
    metrics record is written."""
    norm = torch.linalg.vector_norm(exact.float())
    diff = torch.linalg.vector_norm((approx - exact).float())
    return torch.where(norm > 0, diff / torch.where(norm > 0, norm, 1.0), 0.0)


def exchange_stats(flat: torch.Tensor, n: int, sent_bytes: int,
                   local_error: float | torch.Tensor) -> dict:
    """The stats of one exchange of `flat` over `n` ranks: `dense_bytes` (the bucket),
    `wire_bytes` (what this rank sent), `ratio` (the dense ring all-reduce's wire bytes over
    `wire_bytes`; 1.0 on a group of one, where neither sends anything) and `local_error`."""
    dense = flat.numel() * flat.element_size()
    dense_wire = ring_wire_bytes(dense, n)
    return {"dense_bytes": dense, "wire_bytes": sent_bytes,
            "ratio": dense_wire / sent_bytes if sent_bytes else 1.0,
            "local_error": local_error}


def check_ratio(method: str, ratio) -> float:
    """`ratio` as a float in (0, 1], or a ValueError naming the method and the value."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"compression ratio={ratio!r} for method {method!r} must be a number "
                         f"in (0, 1]: the fraction of values each rank sends")
    return float(ratio)


def kept(ratio: float, numel: int) -> int:
    """k = max(1, ceil(ratio x numel)): how many values a sparsifier keeps."""
    return max(1, math.ceil(ratio * numel))


@dataclass(frozen=True)
class SparsePayload:
    """k values of a bucket and their positions (1-D int64, sorted, unique)."""

    indices: torch.Tensor
    values: torch.Tensor


def densify(payload: SparsePayload, like: torch.Tensor) -> torch.Tensor:
    """The dense tensor shaped as `like`: the payload's values at its indices, zero elsewhere."""
    out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
    out[payload.indices] = payload.values
    return out.view_as(like)


class Exchange:
    """One bucket's exchange in flight. `wait()` completes it: `flat` then holds the sum over
    the axis group, identical bits on every rank, and `stats` (None before) the dict of
    `exchange_stats`, which it also returns."""

    def __init__(self, complete: Callable[[], dict]):
        self._complete = complete
        self.stats: dict | None = None

    def wait(self) -> dict:
        if self._complete is not None:
            self.stats = self._complete()
            self._complete = None
        return self.stats


class Compressor:
    """Per-bucket compression with optional error feedback; docs/compression.md.

    State lives in `self._state[slot][str(key)]`, one slot per kind ("residual", and what a
    subclass adds to `slots`), and travels through `state_dict()` as "slot/key" entries.
    """

    name = "base"
    slots: tuple[str, ...] = ("residual",)

    def __init__(self, error_feedback: bool):
        self.error_feedback = bool(error_feedback)
        self._state: dict[str, dict[str, torch.Tensor]] = {slot: {} for slot in self.slots}

    # --- what a method defines ---------------------------------------------------------------

    def _encode(self, key: str, x: torch.Tensor, shapes) -> object:
        raise NotImplementedError

    def decompress(self, payload, like: torch.Tensor) -> torch.Tensor:
        """This rank's contribution, dense and shaped as `like`."""
        raise NotImplementedError

    def _send(self, x: torch.Tensor, payload, flat: torch.Tensor, mesh, axis: str):
        """Start the collective; return a function that completes it, writes the sum into
        `flat` and returns the wire bytes this rank sent."""
        raise NotImplementedError

    # --- the interface -----------------------------------------------------------------------

    def compress(self, key, flat: torch.Tensor, shapes) -> object:
        """This rank's payload for `flat` (plus the residual under EF); updates the residual."""
        return self._prepare(str(key), flat, shapes)[1]

    def start(self, key, flat: torch.Tensor, shapes, mesh, axis: str) -> Exchange:
        """Compress `flat` and start its exchange over `axis`; the returned `Exchange.wait()`
        writes the sum of every rank's contribution into `flat`. Compression runs here, the
        transfer overlaps whatever the caller does before `wait()`; `flat` belongs to the
        exchange until then (neither read nor written by the caller)."""
        x, payload, local_error = self._prepare(str(key), flat, shapes)
        finish = self._send(x, payload, flat, mesh, axis)
        n = mesh.size(axis)
        return Exchange(lambda: exchange_stats(flat, n, finish(), local_error))

    def residual(self, key) -> torch.Tensor | None:
        """The error-feedback residual of bucket `key` (None before its first call, and
        without EF)."""
        return self._state["residual"].get(str(key))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every piece of state as "slot/key": tensor (copies): EF residuals ("residual/3"),
        PowerSGD's warm-start Q ("q/3"), random-k's call counters ("calls/3")."""
        return {f"{slot}/{key}": t.clone() for slot, table in self._state.items()
                for key, t in table.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace all state by `state` (as `state_dict()` wrote it)."""
        tables: dict[str, dict[str, torch.Tensor]] = {slot: {} for slot in self.slots}
        for name, tensor in state.items():
            slot, _, key = name.partition("/")
            if slot not in tables or not key:
                raise ValueError(f"{self.name} compressor state entry {name!r} is not "
                                 f"'slot/key' with a slot in {self.slots}: a checkpoint of "
                                 f"another compression method?")
            tables[slot][key] = tensor.clone()
        self._state = tables

    # --- error feedback ------------------------------------------------------------------------

    def _input(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """x = flat + residual under EF (a new tensor), else `flat` itself (not modified)."""
        e = self._state["residual"].get(key) if self.error_feedback else None
        if e is None:
            return flat
        if e.numel() != flat.numel():
            raise ValueError(f"bucket {key!r} has {flat.numel()} values but its residual "
                             f"{e.numel()}: the buckets changed since the state was saved")
        return flat + e.view_as(flat).to(flat.device)  # a checkpoint may load on the CPU

    def _settle(self, key: str, x: torch.Tensor, contribution: torch.Tensor) -> torch.Tensor:
        """Keep e = x - contribution under EF; return ||x - contribution|| / ||x||."""
        if self.error_feedback:
            self._state["residual"][key] = x - contribution
        return local_relative_error(contribution, x)

    def _prepare(self, key: str, flat: torch.Tensor, shapes):
        x = self._input(key, flat)
        payload = self._encode(key, x, shapes)
        return x, payload, self._settle(key, x, self.decompress(payload, x))
