"""Stashed activations of the micro-batches in flight: counted, and moved to host memory and
back for the ones a schedule offloads (the PipeOffload idea, arXiv 2503.01328: offload what
waits longest before its backward, reload it just before).

How tensors are captured, copied and counted: docs/pipeline.md, "Recomputation and
activation offload".
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Saved:
    __slots__ = ("tensor", "host", "copy", "nbytes")

    def __init__(self, tensor: torch.Tensor, nbytes: int):
        self.tensor, self.host, self.copy = tensor, None, None
        self.nbytes = nbytes


class ActivationStash:
    def __init__(self, params, device: torch.device):
        self.device = device
        self._params = list(params)
        self._pairs: dict[tuple[int, int], list[Saved]] = {}
        self._offloaded: set[tuple[int, int]] = set()
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="offload")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()
        self.live_bytes = self.peak_bytes = 0
        # wait for each offload and reload to finish before going on: the bytes then move
        # when the schedule says, whatever the machine's load (tests measure the peak so)
        self.synchronous = False

    # --- accounting -------------------------------------------------------------------------

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    # --- saving -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(self, key: tuple[int, int], inputs=()):
        """Autograd's saved tensors of the forward run inside go to pair `key`; `inputs`
        (the received stage input, kept for backward anyway) count too."""
        saved = self._pairs.setdefault(key, [])
        seen = {r.tensor.untyped_storage().data_ptr() for r in saved if r.tensor is not None}
        # the weights' storages as they are now: ZeRO-3 gathers a unit into a buffer it
        # frees after the forward (a weight copied out then would be a copy of nothing)
        weights = {p.untyped_storage().data_ptr() for p in self._params}

        def keep(t: torch.Tensor) -> Saved:
            storage = t.untyped_storage()
            # a storage counts once (the first tensor saved from it carries its bytes):
            # q, k and v are views of one qkv output, a log-softmax is saved twice
            record = Saved(t, 0 if storage.data_ptr() in seen else storage.nbytes())
            seen.add(storage.data_ptr())
            saved.append(record)
            self._add(record.nbytes)
            return record

        for t in inputs:
            if t.is_floating_point():
                keep(t)

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() in weights or t.device != self.device:
                return t  # a weight (or a CPU index tensor): not an activation
            return keep(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _unpack(self, record):
        if not isinstance(record, Saved):
            return record
        if record.copy is not None:  # a copy in flight (out or in): let it finish
            record.copy.result()
            record.copy = None
        if record.tensor is None:  # offloaded and never reloaded: bring it back now
            self._reload_one(record)
        return record.tensor

    def release(self, key: tuple[int, int]) -> None:
        """The pair's backward is done: its activations are garbage (the graph held them)."""
        for record in self._pairs.pop(key, []):
            if record.copy is not None:
                record.copy.result()
            if record.tensor is not None:
                self._add(-record.nbytes)
            record.tensor = record.host = None
        self._offloaded.discard(key)

    # --- offload and reload -----------------------------------------------------------------

    def offload(self, key: tuple[int, int]) -> None:
        """Start copying pair `key`'s activations to host memory; each device tensor is
        dropped (and counted off) when its copy is done."""
        self._offloaded.add(key)
        for record in self._pairs.get(key, []):
            record.copy = self._submit(self._copy_out, record)
        self._settle(key)

    def reload(self, key: tuple[int, int]) -> None:
        """Start copying pair `key`'s activations back to the device."""
        if key not in self._offloaded:
            return
        self._offloaded.discard(key)
        for record in self._pairs.get(key, []):
            if record.copy is not None:
                record.copy.result()  # its copy-out first
            self._add(record.nbytes)
            record.copy = self._submit(self._copy_in, record)
        self._settle(key)

    def _settle(self, key) -> None:
        if self.synchronous:
            self.wait(key)

    def wait(self, key) -> None:
        """Until pair `key`'s copies in flight are done."""
        for record in self._pairs.get(key, []):
            if record.copy is not None:
                record.copy.result()

    def _submit(self, fn, record: Saved) -> Future:
        return self._copier.submit(fn, record)

    def _copy_out(self, record: Saved) -> None:
        t = record.tensor
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._stream is not None)
        with self._on_stream():
            host.copy_(t, non_blocking=self._stream is not None)
            self._synchronize()
        record.host, record.tensor = host, None
        self._add(-record.nbytes)

    def _copy_in(self, record: Saved) -> None:
        with self._on_stream():
            tensor = record.host.to(self.device, non_blocking=self._stream is not None, copy=True)
            self._synchronize()
        record.tensor, record.host = tensor, None

    def _reload_one(self, record: Saved) -> None:
        self._add(record.nbytes)
        self._copy_in(record)

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        self._copier.shutdown(wait=True)
