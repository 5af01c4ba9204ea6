"""Streaming DiLoCo: DiLoCo whose outer step is taken one fragment of the model at a time, at
staggered steps, each fragment's all-reduce in flight while the replicas keep training.

Douillard et al., arXiv 2501.18512. Fragments, overlap, int8, checkpoints, deviations and
failure semantics: docs/lowcomm-streaming.md.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loomtrain import comm
from loomtrain.lowcomm.local_sgd import LocalSGD


def build(model, optimizer, mesh, cfg, seed: int):
    """apply_lowcomm's builder for algorithm="streaming_diloco"."""
    return StreamingDiLoCo(model, mesh, cfg.inner_steps, cfg.fragments, cfg.overlap_steps,
                           cfg.outer_lr, cfg.outer_momentum,
                           nesterov=cfg.outer_optimizer == "nesterov", quantize=cfg.quantize,
                           mix=cfg.mix), optimizer


def split_fragments(names: list[str], fragments: int, blocks: str = "blocks",
                    preceding: dict[str, int] | None = None) -> list[list[int]]:
    """The indices into `names` (parameter names in registration order, each once) of each of
    the `fragments` fragments. Block i (names "<blocks>.<i>.*") goes to fragment i mod F; any
    other parameter to the fragment of the block registered before it, or to fragment 0 before
    the first block. Pure. Raises ValueError when the names hold fewer than F blocks.

    `preceding`: for one pipeline rank's parameters, {name: the block before it in the whole
    model (-1: none)} of those outside blocks (`stage_preceding`); its fragments follow the
    whole model's, and some may be empty there (other stages hold their blocks)."""
    pattern = re.compile(rf"^{re.escape(blocks)}\.(\d+)\.")
    block_of = [int(m.group(1)) if (m := pattern.match(n)) else None for n in names]
    count = len({b for b in block_of if b is not None})
    if preceding is None and (fragments < 1 or fragments > count):
        raise ValueError(f"streaming DiLoCo makes {fragments} fragments of whole blocks "
                         f"(parameters named {blocks}.<i>.*), and this model has {count}: "
                         f"set lowcomm.fragments between 1 and {max(count, 1)}")
    out: list[list[int]] = [[] for _ in range(fragments)]
    current = 0
    for index, (name, block) in enumerate(zip(names, block_of)):
        if block is not None:
            current = block % fragments
        elif preceding is not None:
            current = max(preceding[name], 0) % fragments
        out[current].append(index)
    assert preceding is not None or all(out), \
        f"a fragment without a block: blocks {sorted(set(block_of) - {None})}"
    return out


def stage_preceding(module: nn.Module, names: list[str], blocks: str = "blocks") -> dict | None:
    """For a pipeline rank's module (parallel/pipeline/split.py's PipelineModule, whose
    `layers` are the whole model's, in order): {name: the block before it in the whole model,
    -1 for none} of its parameters outside blocks; None for a whole model. A parameter several
    stages hold (`pp_copies`: the tied embedding and head) gets -1 everywhere: a whole model
    registers it under its first name, the embedding's, before every block, and its copies
    must sync at the same steps."""
    from loomtrain.parallel.pipeline.split import PipelineModule
    from loomtrain.parallel.zero.engine import ShardedDataParallel

    if isinstance(module, ShardedDataParallel):  # a sharded replica: its stage's module
        if isinstance(module.module, PipelineModule):
            return stage_preceding(module.module, names, blocks)
        return _shard_preceding(module.module, names, blocks)
    if not isinstance(module, PipelineModule):
        return None
    pattern = re.compile(rf"^{re.escape(blocks)}\.(\d+)$")
    before, last = {}, -1
    for layer in module.layers:
        for path in layer.owns:
            if m := pattern.match(path):
                last = int(m.group(1))
            before[path] = last
    params = dict(module.named_parameters())
    out = {}
    for name in names:
        owner = next((p for p in before if name.startswith(p + ".")), None)
        shared = getattr(params[name], "pp_copies", 1) > 1
        out[name] = -1 if shared or owner is None else before[owner]
    return out


def _shard_preceding(module: nn.Module, names: list[str], blocks: str) -> dict:
    """`stage_preceding` for a rank's slices of a ZeRO-sharded replica (`names`: their
    parameters, in unit order, not registration order, and only some blocks'): {name: the
    block registered before it in the whole model, -1 for none} of those outside blocks."""
    pattern = re.compile(rf"^{re.escape(blocks)}\.(\d+)\.")
    before, last = {}, -1
    for name, _ in module.named_parameters():
        if m := pattern.match(name):
            last = int(m.group(1))
        before[name] = last
    return {name: before[name] for name in names if not pattern.match(name)}


def sync_offsets(inner_steps: int, fragments: int) -> list[int]:
    """Fragment p syncs at the steps s (counted from 1) with (s - offsets[p]) % H == 0."""
    assert inner_steps % fragments == 0, (inner_steps, fragments)
    return [p * inner_steps // fragments for p in range(fragments)]


class _Done:
    """A sync already waited for (a run that outlives lost replicas: `_launch`)."""

    def wait(self) -> None:
        pass


_DONE = _Done()


@dataclass
class InFlight:
    """One fragment's pseudo-gradient all-reduce, started at `launched_step`."""
    fragment: int
    launched_step: int
    pseudo_gradient: torch.Tensor  # the sum over the replicas once `pending` is waited for
    pending: object  # comm.Pending or comm.PendingQuantized
    launched_s: float  # perf_counter at the launch
    wire_bytes: int  # what this replica sends for it (comm's meter)


class StreamingDiLoCo(LocalSGD):
    """`model = StreamingDiLoCo(model, mesh, inner_steps=H, fragments=F, overlap_steps=tau)`;
    the inner optimizer is the caller's, the F outer ones (SGD, Nesterov momentum when
    `nesterov`) belong to the wrapper.

    What a benchmark reads: `fragment_params` (the parameters of each fragment),
    `sync_log` (one dict per landed sync: fragment, launched_step, landed_step, launched_s,
    wait_s, landed_s, wire_bytes) and `metrics()`."""

    def __init__(self, module: nn.Module, mesh, inner_steps: int, fragments: int = 1,
                 overlap_steps: int = 0, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, quantize: str = "none", mix: float = 0.5,
                 axis: str | None = None):
        super().__init__(module, mesh, inner_steps, axis)
        if inner_steps % fragments or overlap_steps >= inner_steps // fragments:
            raise ValueError(f"streaming DiLoCo needs inner_steps ({inner_steps}) a multiple of "
                             f"fragments ({fragments}) and overlap_steps ({overlap_steps}) below "
                             "their ratio")
        assert quantize in ("none", "int8") and 0.0 <= mix < 1.0, (quantize, mix)
        self.overlap_steps, self.quantize, self.mix = overlap_steps, quantize, mix
        self.fragment_index = split_fragments(self.names, fragments,
                                              preceding=stage_preceding(module, self.names))
        self.fragment_params = [[self.params[i] for i in f] for f in self.fragment_index]
        self.offsets = sync_offsets(inner_steps, fragments)
        # theta_p: after the broadcast, every replica's copy is dp rank 0's parameters
        self.global_params = [self._flat(p).clone() for p in range(fragments)]
        momentum = outer_momentum if nesterov else 0.0
        self.outer = [torch.optim.SGD([g], lr=outer_lr, momentum=momentum, nesterov=nesterov)
                      for g in self.global_params]
        self.in_flight: list[InFlight] = []
        self.step = 0  # the last step after_step saw
        self.differs = [False] * fragments  # whether the replicas may hold different values
        self.sync_log: list[dict] = []
        self._launched: int | None = None  # this step's, for metrics()
        self._landed: int | None = None
        self._window_bytes, self._window_payload, self._window_wait_s = 0, 0, 0.0

    @property
    def fragments(self) -> int:
        return len(self.fragment_index)

    def _flat(self, p: int) -> torch.Tensor:
        if not self.fragment_params[p]:  # a pipeline rank that holds none of its blocks
            return self.params[0].new_empty(0, device=self.mesh.device)
        return self.flat_params(self.fragment_params[p])

    def _set_fragment(self, p: int, flat: torch.Tensor) -> None:
        for t, value in zip(self.fragment_params[p],
                            _unflatten_dense_tensors(flat, self.fragment_params[p])):
            t.copy_(value)
        self.published()

    def after_step(self, step: int, last: bool = False) -> bool:
        """Call after optimizer step `step` (counted from 1) on every replica: launches the
        all-reduce of each fragment whose sync step this is, lands those launched
        `overlap_steps` steps ago, and on `last` ends on one model (`end_period`). Returns
        whether a fragment was launched."""
        self.step, self.differs = step, [bool(f) for f in self.fragment_params]
        self._launched = self._landed = None
        for p, offset in enumerate(self.offsets):
            if (step - offset) % self.inner_steps == 0 and self.fragment_params[p]:
                self._launch(p, step)
        for sync in [s for s in self.in_flight if step >= s.launched_step + self.overlap_steps]:
            self._land(sync)
        if last:
            self.end_period()
        return self._launched is not None

    @torch.no_grad()
    def _launch(self, p: int, step: int) -> None:
        """Start the all-reduce (sum) of fragment p's pseudo-gradient theta_p - theta_{i,p}.

        In a run that outlives lost replicas (`sync_guard` set, lowcomm/replicas.py) it is
        waited for here, through the guard, which retries it from the kept pseudo-gradient in
        a re-formed group: an all-reduce in flight across steps could not be retried once its
        group was gone. It still lands `overlap_steps` later: the same maths, without the
        overlap of communication."""
        pseudo_gradient = torch.sub(self.global_params[p], self._flat(p))
        sent = self.mesh.meter.total("wire_bytes")
        reduce = comm.quantized_all_reduce if self.quantize == "int8" else comm.all_reduce
        if self.sync_guard is None:
            pending = reduce(pseudo_gradient, self.mesh, self.axis, async_op=True)
        else:
            def attempt() -> torch.Tensor:
                total = pseudo_gradient.clone()
                reduce(total, self.mesh, self.axis)
                return total
            pending, pseudo_gradient = _DONE, self.sync_guard(attempt)
            if pseudo_gradient is None:  # caught up: this replica took a peer's state, this
                return                   # sync included (replica_state)
        sent = self.mesh.meter.total("wire_bytes") - sent
        self.in_flight.append(InFlight(p, step, pseudo_gradient, pending, time.perf_counter(),
                                       sent))
        self._launched = p
        self._window_bytes += sent
        self._window_payload += pseudo_gradient.numel() * pseudo_gradient.element_size()

    @torch.no_grad()
    def _land(self, sync: InFlight) -> None:
        """Wait for `sync`, step theta_p on the mean pseudo-gradient, merge it into the local
        fragment (replace with tau = 0 or mix = 0; mix * local + (1 - mix) * global else)."""
        p, waited = sync.fragment, time.perf_counter()
        sync.pending.wait()
        landed = time.perf_counter()
        self.in_flight.remove(sync)
        sync.pseudo_gradient.div_(self.mesh.size(self.axis))
        theta = self.global_params[p]
        theta.grad = sync.pseudo_gradient
        self.outer[p].step()
        theta.grad = None
        if self.overlap_steps == 0 or self.mix == 0.0:
            self._set_fragment(p, theta)
            self.differs[p] = False
        else:
            self._set_fragment(p, torch.lerp(theta, self._flat(p), self.mix))
        self._landed = p
        self._window_wait_s += landed - waited
        self.sync_log.append(dict(fragment=p, launched_step=sync.launched_step,
                                  landed_step=self.step, launched_s=sync.launched_s,
                                  wait_s=waited, landed_s=landed, wire_bytes=sync.wire_bytes))

    @torch.no_grad()
    def end_period(self) -> None:
        """Land every sync in flight now (in launch order), then average over the replicas the
        local parameters of every fragment they may hold differently (`synchronize`): all
        replicas hold one model and nothing is in flight. theta_p and the outer momenta are
        left as they are."""
        for sync in list(self.in_flight):
            self._land(sync)
        if any(self.differs):
            self._sync(settle=True)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average over the replicas the local parameters of every fragment they may hold
        differently (one all-reduce). A failed one changes nothing: it reduces a copy."""
        differing = [p for p in range(self.fragments) if self.differs[p]]
        if not differing:
            return
        locals_ = [self._flat(p) for p in differing]
        flat = _flatten_dense_tensors(locals_)
        comm.all_reduce(flat, self.mesh, self.axis)
        flat.div_(self.mesh.size(self.axis))
        for p, value in zip(differing, _unflatten_dense_tensors(flat, locals_)):
            self._set_fragment(p, value)
            self.differs[p] = False

    def metrics(self) -> dict:
        """Since the previous call: the fragment launched and the one landed at the last step
        (None: none), the fragments in flight now, the wire and payload bytes this replica sent
        for pseudo-gradients, and the seconds it blocked waiting for them."""
        out = {"fragment_launched": self._launched, "fragment_landed": self._landed,
               "fragments_in_flight": len(self.in_flight),
               "pseudo_gradient_wire_bytes": self._window_bytes,
               "pseudo_gradient_payload_bytes": self._window_payload,
               "outer_wait_s": round(self._window_wait_s, 6)}
        self._window_bytes, self._window_payload, self._window_wait_s = 0, 0, 0.0
        return out

    # checkpoint hooks (lowcomm/state.py): theta_p and the momentum of every fragment
    def outer_state(self) -> dict[str, torch.Tensor]:
        """theta ("global.<name>") and the outer momentum ("momentum_buffer.<name>", without
        momentum none) of every parameter, as fresh tensors: identical on every replica after
        `end_period`."""
        state = {}
        for p, params in enumerate(self.fragment_params):
            names = [self.names[i] for i in self.fragment_index[p]]
            theta = self.global_params[p]
            tensors = {"global": theta}
            if self.outer[p].defaults["momentum"]:
                buffer = self.outer[p].state[theta].get("momentum_buffer")
                # before the first outer step: zero momentum, the same update
                tensors["momentum_buffer"] = torch.zeros_like(theta) if buffer is None else buffer
            for kind, flat in tensors.items():
                for n, view in zip(names, _unflatten_dense_tensors(flat, params)):
                    state[f"{kind}.{n}"] = view.clone()
        return state

    @torch.no_grad()
    def load_outer_state(self, state: dict[str, torch.Tensor]) -> None:
        """After the model's parameters were loaded: theta_p and the momenta are the saved
        ones; nothing in flight, every fragment one model."""
        super().load_outer_state(state)
        self.in_flight.clear()
        self.differs = [False] * self.fragments
        for p, indices in enumerate(self.fragment_index):
            names = [self.names[i] for i in indices]
            if not names:
                continue
            theta = _flatten_dense_tensors([state[f"global.{n}"] for n in names])
            self.global_params[p].copy_(theta)
            if self.outer[p].defaults["momentum"]:
                buffer = _flatten_dense_tensors([state[f"momentum_buffer.{n}"] for n in names])
                self.outer[p].state[self.global_params[p]]["momentum_buffer"] = buffer

    def one_model(self) -> bool:
        """Only after `end_period`: between, each fragment's local copy moves apart."""
        return not self.in_flight and not any(self.differs)

    def joinable(self) -> bool:
        """At any step boundary: a joiner copies one peer's replica whole (`replica_state`),
        syncs still to land included, as a restarted torchft replica copies a peer's."""
        return True

    # what a replica taking a peer's place copies (lowcomm/replicas.py): theta_p and the
    # momenta, and the syncs still to land, in tensors of one layout on every replica
    def replica_state(self) -> dict[str, torch.Tensor]:
        """`outer_state`, each fragment's reduced pseudo-gradient still to land ("pending.<p>",
        zeros if none), the step it was launched at ("launched", -1: none) and whether the
        replicas may hold it differently ("differs"). Fresh tensors."""
        state = self.outer_state()
        launched = torch.full((self.fragments,), -1.0, dtype=torch.float64)
        pending = [torch.zeros_like(theta) for theta in self.global_params]
        for sync in self.in_flight:
            launched[sync.fragment] = sync.launched_step
            pending[sync.fragment] = sync.pseudo_gradient.clone()
        state.update({f"pending.{p}": t for p, t in enumerate(pending)})
        state["launched"] = launched
        state["differs"] = torch.tensor(self.differs, dtype=torch.float64)
        return state

    @torch.no_grad()
    def load_replica_state(self, state: dict[str, torch.Tensor]) -> None:
        self.load_outer_state(state)
        self.differs = [bool(d) for d in state["differs"].tolist()]
        launched = state["launched"].tolist()
        order = sorted((int(s), p) for p, s in enumerate(launched) if s >= 0)
        self.in_flight = [InFlight(p, s, state[f"pending.{p}"], _DONE, time.perf_counter(), 0)
                          for s, p in order]
