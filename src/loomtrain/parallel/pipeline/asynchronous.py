"""Asynchronous pipeline training (`parallel.schedule = "async"`): no flush, an optimizer step
per micro-batch and stage on the weights its forward used (PipeDream's weight stashing,
Narayanan et al., SOSP 2019), with the delay-corrected Nesterov of Ajanthan et al. (ICML 2025,
arXiv 2505.01099) or the plain optimizer. Schedule, delays, tied weights and messages:
docs/pipeline.md, "The asynchronous runtime in detail".
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch.func import functional_call

from loomtrain import comm
from loomtrain.errors import ConfigError
from loomtrain.parallel.pipeline import schedules as S
from loomtrain.parallel.pipeline.async_weights import LiveWeights, ShardedWeights
from loomtrain.parallel.pipeline.nesterov import build_async_optimizer
from loomtrain.parallel.pipeline.runtime import LocalGradients, PipelineRuntime, _StepState

_TIED = 3  # a tied parameter's gradient contribution, in its tag (runtime.py's kinds are 0-2)
_TAG_SPAN = 1 << 20  # micro-batches a tag tells apart: far more than are ever in flight


# --- the order of one rank's work: pure -----------------------------------------------------

def step_actions(stage: int, pp: int, first: int, microbatches: int, cold: int) -> list[S.Action]:
    """Rank `stage`'s compute in the trainer step of micro-batches first .. first+M-1: each F
    followed by the B of the micro-batch pp-1-stage before it, none before `cold` (the first
    micro-batch since the pipeline was last empty)."""
    in_flight = pp - 1 - stage
    out = []
    for g in range(first, first + microbatches):
        out.append(S.Action(S.F, g, stage))
        if g - in_flight >= cold:
            out.append(S.Action(S.B, g - in_flight, stage))
    return out


def drain_actions(stage: int, pp: int, end: int, cold: int) -> list[S.Action]:
    """The backwards rank `stage` still owes when the stream stops before micro-batch `end`."""
    return [S.Action(S.B, g, stage) for g in range(max(cold, end - (pp - 1 - stage)), end)]


def delays(actions: list[S.Action]) -> dict[int, int]:
    """{micro-batch: updates between its F and its B} along one rank's actions (an update
    follows every B)."""
    version, at, out = 0, {}, {}
    for a in actions:
        if a.kind == S.F:
            at[a.microbatch] = version
        else:
            out[a.microbatch] = version - at.pop(a.microbatch)
            version += 1
    return out


# --- the runtime ----------------------------------------------------------------------------

class AsyncPipelineRuntime(PipelineRuntime):
    """One rank's executor of the asynchronous stream (docs/pipeline.md). It owns `optimizer`:
    the trainer neither clips nor steps; after `train_step`, `grad_norm` (the root mean square
    over the step's updates of the model's gradient norm, stage norms summed in squares) and
    `stepped` (no update of the step was skipped) describe the step. Set `trace` to a list to
    record every F and B (with the weights used, for tests)."""

    owns_optimizer = True

    def __init__(self, stages, mesh, microbatches: int, shapes, shared, optimizer, grad_clip: float):
        pp = mesh.size("pp")
        # actions are made step by step (step_actions), not fixed: the schedule holds none
        super().__init__(stages, mesh, S.Schedule("async", pp, microbatches, 1, ((),) * pp), shapes, shared)
        self.optimizer, self.grad_clip = optimizer, grad_clip
        self.weights = LiveWeights()  # `shard` puts them in ZeRO's engine
        self.named = list(self.module.named_parameters())  # this rank's one stage's
        self.tied_ids = {id(p) for p, _ in shared if p is not None}
        self.holders = self._holders()
        self.lag = pp  # updates between a tied contribution and its use (docs/pipeline.md)
        self.wait_steps = math.ceil((pp - 1) / microbatches)
        self.next = self.cold = 0  # the next micro-batch; the first since the pipeline was empty
        self.version = 0  # updates this stage has made
        self.batches: dict = {}  # micro-batch -> (x, y), until its forward
        self.lrs: dict = {}  # micro-batch -> its step's learning rates, one per group
        self.stashes: dict = {}  # micro-batch -> (weights its forward used, its input)
        self.tied_own: dict = {}  # micro-batch -> this rank's contributions, per shared index
        self.tied_recv: dict = {}  # (micro-batch, shared index, rank) -> (buffer, pending)
        self.sent: deque = deque()  # per step, its sends not yet waited for
        self._step = None  # what is in flight (outputs, inputs, messages): lives across steps
        self.grad_norm, self.stepped = torch.zeros(()), True
        self.trace: list | None = None

    def _holders(self) -> list[list[int]]:
        """The pp ranks holding each shared parameter (one small all-gather, at build time)."""
        if not self.shared:
            return []
        have = torch.tensor([float(p is not None) for p, _ in self.shared], device=self.mesh.device)
        out = torch.empty((self.pp, len(self.shared)), device=self.mesh.device)
        comm.all_gather(out, have, self.mesh, "pp")
        return [[r for r in range(self.pp) if out[r, i] > 0] for i in range(len(self.shared))]

    def shard(self, engine) -> None:
        """Step in ZeRO's engine (`engine`, a ShardedDataParallel over this rank's stages):
        the optimizer over this rank's slices, stashes gathered from the shards."""
        from loomtrain.parallel.zero.optimizer import ShardedOptimizer

        self.optimizer = ShardedOptimizer(self.optimizer, engine)
        self.weights = ShardedWeights(engine, self.optimizer)

    # --- the trainer's interface --------------------------------------------------------

    def train_step(self, engine, batches, global_tokens: float, loss_fn) -> torch.Tensor:
        """Feeds `batches` (one (x, y) per micro-batch) into the stream and runs this rank's
        actions of the step (`engine`: the dp engine, None for none, as the synchronous
        runtime's); returns the token-summed loss of the step's micro-batches on the last
        stage (zero elsewhere). Collective over pp (the step's gradient norm)."""
        microbatches = self.schedule.microbatches
        if len(batches) != microbatches:
            raise ValueError(f"the async pipeline runs {microbatches} micro-batches a step, "
                             f"got {len(batches)}")
        engine = LocalGradients() if engine is None else engine
        if self._step is None:
            self._step = _StepState(engine, None, 0.0, loss_fn, self.mesh.device)
        st = self._step
        st.engine, st.loss_fn, st.global_tokens = engine, loss_fn, global_tokens / microbatches
        st.loss_sum = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        first = self.next
        self.next += microbatches
        self.step_lrs = [g["lr"] for g in self.optimizer.param_groups]
        for i, batch in enumerate(batches):
            self.batches[first + i], self.lrs[first + i] = batch, self.step_lrs
        self.stats = torch.zeros(3, dtype=torch.float64, device=self.mesh.device)
        self._run(step_actions(self.rank, self.pp, first, microbatches, self.cold))
        self._wait_sends(self.wait_steps)
        local = self.stats.clone()
        local[0] /= max(float(self.stats[2]), 1.0)  # mean square over this stage's updates
        comm.all_reduce(local, self.mesh, "pp")
        self.grad_norm, self.stepped = local[0].sqrt(), bool(local[1] == 0)
        return st.loss_sum

    def drain(self) -> None:
        """Runs the backwards (and updates) of every micro-batch in flight; the next step
        starts with an empty pipeline. Call it on every rank (it exchanges messages)."""
        if self._step is None:
            return
        self.stats = torch.zeros(3, dtype=torch.float64, device=self.mesh.device)
        self._run(drain_actions(self.rank, self.pp, self.next, self.cold))
        self.cold = self.next
        self._wait_sends(0)

    # --- execution ----------------------------------------------------------------------

    def _input_shape(self, microbatch: int) -> None:
        """Every micro-batch has the shape the stages' output shapes were found for (the
        stream keeps no step's batches)."""
        return None

    def _run(self, actions: list[S.Action]) -> None:
        for a in actions:  # receives first, so messages arrive while this rank computes
            if a.kind == S.F and a.stage > 0:
                self._recv(S.Action(S.RECV_F, a.microbatch, a.stage))
            elif a.kind == S.B and a.stage < self.last:
                self._recv(S.Action(S.RECV_B, a.microbatch, a.stage))
        for a in actions:
            (self._forward if a.kind == S.F else self._backward)(a)
        for group, lr in zip(self.optimizer.param_groups, self.step_lrs):
            group["lr"] = lr  # the trainer's, for its log and checkpoint

    def _forward(self, a: S.Action) -> None:
        st, g, s = self._step, a.microbatch, a.stage
        x, y = self.batches.pop(g)
        if s > 0:
            x = self._received(st.recv_f, (g, s)).requires_grad_(True)
            st.inputs[(g, s)] = x
        stash = self.weights.snapshot(self.named)
        if self.trace is not None:
            self.trace.append({"kind": "F", "microbatch": g, "stage": s, "version": self.version,
                               "weights": _flat(p for _, p in self.named)})
        with self.weights.aside():
            out = functional_call(self.module, stash, (x, s))
        if s == self.last:
            loss = st.loss_fn(out, y)
            st.loss_sum += loss.detach()
            out = loss / st.global_tokens  # the micro-batch's share of the step's tokens
        st.outputs[(g, s)] = out
        self.stashes[g] = (stash, x)
        if s < self.last:
            self._send(S.Action(S.SEND_F, g, s))

    def _backward(self, a: S.Action) -> None:
        st, g, s = self._step, a.microbatch, a.stage
        grad = None if s == self.last else self._received(st.recv_b, (g, s))
        torch.autograd.backward(st.outputs.pop((g, s)), grad)
        if s > 0:
            st.grads[(g, s)] = st.inputs.pop((g, s)).grad
            self._send(S.Action(S.SEND_B, g, s))
        stash, x = self.stashes.pop(g)
        if self.trace is not None:
            self.trace.append({"kind": "B", "microbatch": g, "stage": s, "version": self.version,
                               "weights": _flat(stash.values()), "live": _flat(p for _, p in self.named),
                               "stash": stash, "input": x, "grad_output": grad,
                               "grads": {n: t.grad for n, t in stash.items()}})
        self._update(g, stash)

    def _update(self, g: int, stash: dict) -> None:
        """The update after B(g): this rank's gradients at the stash, the tied parameters'
        exchanged over pp (`_tied_gradients`), all summed over dp, clipped per group (the
        untied parameters, then each tied one) and stepped; a group whose norm is not finite
        is left alone."""
        grads = {p: stash[n].grad for n, p in self.named}
        grads.update(self._tied_gradients(g, grads))
        self.weights.reduce(grads, self._step.engine)
        rest = [p for _, p in self.named if id(p) not in self.tied_ids and self.weights.has(p)]
        norm = self.weights.clip(rest, self.grad_clip)
        if torch.isfinite(norm):
            self.stats[0] += float(norm) ** 2
        else:
            self.weights.skip(rest)
            self.stats[1] += 1
        for i, (p, _) in enumerate(self.shared):
            if p is None or not self.weights.has(p):
                continue
            norm = self.weights.clip([p], self.grad_clip)
            if torch.isfinite(norm):
                self.stats[0] += float(norm) ** 2 / len(self.holders[i])
            else:
                self.weights.skip([p])
                self.stats[1] += 1
        self.stats[2] += 1
        for group, lr in zip(self.optimizer.param_groups, self.lrs.pop(g)):
            group["lr"] = lr
        self.weights.step(self.optimizer)
        self.version += 1

    def _tied_gradients(self, g: int, grads: dict) -> dict:
        """Sends this rank's contributions of micro-batch g (`grads`, before the dp sum) to
        the other holders, posts the receives of theirs, and returns {tied parameter: the sum
        of every holder's contributions of micro-batch g - lag} (None before there are any),
        summed over dp with the rest afterwards."""
        if not self.tied_ids:
            return {}
        mine = {}
        for i, (p, shape) in enumerate(self.shared):
            if p is None:
                continue
            mine[i] = grads[p].detach().float()  # fp32 sums, also under bf16
            for h in self.holders[i]:
                if h == self.rank:
                    continue
                tag = self._tag(_TIED, g, i)
                pending = comm.send(mine[i], self.mesh, "pp", h, async_op=True, tag=tag)
                self._step.sends.append((pending, mine[i]))
                buffer = torch.empty(shape, dtype=torch.float32, device=self.mesh.device)
                pending = comm.recv(buffer, self.mesh, "pp", h, async_op=True, tag=tag)
                self.tied_recv[(g, i, h)] = (buffer, pending)
        self.tied_own[g] = mine
        past, totals = g - self.lag, {}
        own = self.tied_own.pop(past, None)
        for i, (p, _) in enumerate(self.shared):
            if p is None:
                continue
            totals[p] = None
            if own is None:
                continue
            for h in self.holders[i]:  # one order on every holder: equal sums, equal copies
                if h == self.rank:
                    part = own[i]
                else:
                    part, pending = self.tied_recv.pop((past, i, h))
                    pending.wait()
                totals[p] = part if totals[p] is None else totals[p] + part
        return totals

    def _wait_sends(self, keep_steps: int) -> None:
        """Files this step's sends and waits for those sent more than `keep_steps` steps ago
        (their receives are posted by now: docs/pipeline.md)."""
        self.sent.append(self._step.sends)
        self._step.sends = []
        while len(self.sent) > keep_steps:
            for pending, _ in self.sent.popleft():
                pending.wait()

    def _tag(self, what: int, microbatch: int, stage: int) -> int:
        """As the synchronous runtime's, with stream positions (mod 2^20) for micro-batches;
        a tied contribution names its shared parameter's index in place of the stage."""
        return (what * self.schedule.stages + stage) * _TAG_SPAN + microbatch % _TAG_SPAN


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors]).clone()


def build_async_runtime(module, mesh, cfg, shapes, shared) -> AsyncPipelineRuntime:
    """The runtime of `schedule = "async"` for this rank's PipelineModule (its stage modules),
    with its optimizer over the PipelineModule's parameters."""
    if mesh.device.type != "cpu":  # known only once the device is picked ("auto")
        raise ConfigError('parallel.schedule="async" runs on CPU ranks for now: its messages '
                          "are matched by tag (gloo), NCCL matches in order; set run.device=\"cpu\"")
    return AsyncPipelineRuntime(module.stage_modules(), mesh, cfg.accumulation_steps, shapes,
                                shared, build_async_optimizer(module, cfg), cfg.train.grad_clip)
