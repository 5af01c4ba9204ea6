"""Executes a pipeline schedule on this rank: the actions of `schedule.actions[rank]` in order
(forwards, backwards or zero-bubble's split I and W, sends and receives, offloads and
reloads), with recomputation and the gradient sync over pp, then dp. What it is given (stage
modules, shapes, shared parameters, a gradient engine) and what each action does:
docs/pipeline.md, "The runtime".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from loomtrain import comm
from loomtrain.parallel.pipeline import schedules as S
from loomtrain.parallel.pipeline.offload import ActivationStash

_ACT, _GRAD, _EVAL = 0, 1, 2  # what a message carries, in its tag


class DeferredWeightGrads:
    """While `deferring(key)` is active, linear layers patched by `defer_linear_weights` skip
    their weight and bias gradients in backward and leave a closure computing them under
    `key`; `run(key)` computes and accumulates them into `.grad`."""

    def __init__(self):
        self.key = None
        self.pending: dict = {}

    @contextlib.contextmanager
    def deferring(self, key):
        self.key = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    @torch.no_grad()
    def run(self, key) -> None:
        for weight, bias, x, dy in self.pending.pop(key, []):
            x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
            _accumulate(weight, dy2.t() @ x2)
            if bias is not None:
                _accumulate(bias, dy2.sum(0))


def _accumulate(p: nn.Parameter, grad: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = grad
    else:
        p.grad.add_(grad)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        # the parameters themselves: a saved tensor unpacks as another tensor object, and
        # the deferred gradient must land in the parameter's own .grad
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        if ctx.store.key is not None:
            ctx.store.pending[ctx.store.key].append((ctx.weight, ctx.bias, x, dy))
            return dx, None, None, None
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dw = dy2.t() @ x2 if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.bias is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def _deferrable_forward(module: nn.Linear, store: DeferredWeightGrads, x: torch.Tensor):
    return _Linear.apply(x, module.weight, module.bias, store)


def defer_linear_weights(module: nn.Module, store: DeferredWeightGrads) -> int:
    """Patch every plain `nn.Linear` of `module` to defer its weight gradient into `store`
    (subclasses, such as the tensor-parallel layers, keep their own backward). Returns how
    many were patched."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.forward = partial(_deferrable_forward, m, store)
            n += 1
    return n


# Receives are posted this many compute actions before the schedule places them. A gloo
# receive posted late costs its compute the time gloo's I/O thread needs to hand the
# message over, ~2 ms on a loaded 2-core machine (benchmarks/pipeline.py's timelines); a
# receive posted early only holds its buffer longer.
RECV_LOOKAHEAD = 2


def posted_early(actions, lookahead: int) -> tuple:
    """`actions` with every RECV moved `lookahead` compute actions earlier (not before the
    start), keeping the receives' order among themselves (the FIFO order NCCL needs) and
    everything else in place."""
    keyed, computes = [], 0
    for i, a in enumerate(actions):
        if a.kind in S.COMPUTE:
            computes += 1
        at = max(computes - lookahead, 0) - 0.5 if a.kind in (S.RECV_F, S.RECV_B) else computes
        keyed.append((at, i, a))
    return tuple(a for _, _, a in sorted(keyed, key=lambda k: (k[0], k[1])))


class LocalGradients:
    """The gradient engine of a rank whose gradients nothing reduces (no data parallelism):
    they stay where backward put them."""

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def sync_gradients(self) -> None:
        pass


class RankStages(nn.ModuleDict):
    """This rank's stage modules in one module, under str(stage): `forward(x, stage)` runs
    one. What works on all of them at once uses it: their parameters (deduplicated), the
    weight-gradient deferral, the asynchronous runtime's `functional_call`."""

    def __init__(self, stages: Mapping[int, nn.Module]):
        super().__init__({str(s): m for s, m in sorted(stages.items())})

    def forward(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        return self[str(stage)](x)


class PipelineRuntime:
    """One rank's executor of `schedule` over the stage modules it is given.

    `stages`: {stage: module} for exactly the stages the schedule places on this rank (stage
    s on pp rank s % pp); `module(x)` runs stage s on its input (stage 0: the micro-batch's
    tokens), any module: a slice of a model's layers (`PipelineModule.stage_modules()`), a
    tensor-parallel block, a hand-built one. `shapes[s]`: stage s's output (shape, dtype) for
    one micro-batch, for every stage that sends (s < stages - 1), found for an input of
    `sample_shape`: a micro-batch with other rows or tokens gets buffers of its own
    (`output_shape`). `shared`: the parameters
    several pp ranks hold (a tied embedding and head), as [(this rank's copy or None, shape)]
    in one order on every pp rank; their gradients are summed over pp. The loss is the
    runtime's: `loss_fn(last stage's output, targets)`. The gradient engine (dp's) is given
    to each `train_step`."""

    def __init__(self, stages: Mapping[int, nn.Module], mesh, schedule: S.Schedule, shapes,
                 shared, recompute: str = "none", sample_shape: tuple | None = None):
        self.mesh, self.schedule = mesh, schedule
        self.rank, self.pp = mesh.local_rank("pp"), mesh.size("pp")
        self.last = schedule.stages - 1
        _check_stages(stages, shapes, schedule, self.rank, self.pp)
        self.stages = dict(stages)
        self.module = RankStages(stages)
        self.shapes = shapes  # stage s's output (shape, dtype), for a micro-batch
        self.sample_shape = sample_shape  # the input `shapes` were found for (None: not given)
        self.recompute = recompute
        self.deferred = DeferredWeightGrads()
        if any(a.kind == S.I for a in schedule.actions[self.rank]):
            defer_linear_weights(self.module, self.deferred)
        self.stash = ActivationStash(self.module.parameters(), mesh.device)
        # the stash's hooks cost a Python call per saved tensor: they run for the pairs the
        # schedule offloads, and for all while `measure_activations` is set (peak_bytes)
        self.measure_activations = False
        self.use(schedule)
        self.spans: list[dict] | None = None  # per-action spans while a step is recorded
        self.costs = None  # a planned schedule's stage costs (optimal_costs.StageCosts)
        # parameters held on several pp ranks, in one order everywhere: (local or None, shape)
        self.shared = shared

    def use(self, schedule: S.Schedule) -> None:
        """Run `schedule` from the next step on (of the same stages; its I actions need the
        weight-gradient deferral set up at construction, by a schedule that had some)."""
        self.schedule = schedule
        self.actions = posted_early(schedule.actions[self.rank], RECV_LOOKAHEAD)
        self.offloaded = {(a.microbatch, a.stage) for a in self.actions if a.kind == S.OFFLOAD}

    @property
    def defers_weight_grads(self) -> bool:
        """Whether this rank's schedule splits backwards into I and W actions: its I actions
        read the linear weights whose gradients its W actions add later, outside autograd
        (no gradient hook sees them)."""
        return any(a.kind == S.I for a in self.actions)

    def bubble_theory(self) -> float:
        """The schedule's bubble by its formula; a planned schedule's (optimal), simulated
        with the stage costs it was planned with."""
        s = self.schedule
        if s.name in S.SCHEDULES:
            return S.bubble_theory(s.name, s.pp, s.microbatches, s.virtual_stages)
        from loomtrain.parallel.pipeline.optimal_costs import action_times

        return S.simulate(s, action_times(self.costs, s.recompute)).bubble

    # --- one training step ------------------------------------------------------------------

    def train_step(self, engine, batches, global_tokens: float, loss_fn,
                   before=None) -> torch.Tensor:
        """Runs the schedule over `batches` (one (x, y) per micro-batch) through the stage
        modules. `engine`: the gradient engine of the stages' parameters, anything with
        `no_sync()` and `sync_gradients()` (the dp engine, DataParallel or ZeRO-1, built with
        `gradient_reduce="sum"` as the trainer builds it: the loss is divided by
        `global_tokens`); None: `LocalGradients()`. Gradients end summed over the pp copies of
        shared parameters, then over dp. `before(m)`, if given, runs before every forward of
        micro-batch m (and its recomputation): the sequence runtime's context of that
        micro-batch's documents and positions, under context parallelism. Returns this rank's
        token-summed loss (zero off the last stage)."""
        if len(batches) != self.schedule.microbatches:
            raise ValueError(f"the schedule has {self.schedule.microbatches} micro-batches, "
                             f"the step {len(batches)}")
        engine = LocalGradients() if engine is None else engine
        self._step = _StepState(engine, batches, global_tokens, loss_fn, self.mesh.device, before)
        self.stash.reset_peak()
        run = {S.F: self._forward, S.B: self._backward, S.I: self._backward, S.W: self._weights,
               S.SEND_F: self._send, S.SEND_B: self._send, S.RECV_F: self._recv,
               S.RECV_B: self._recv, S.OFFLOAD: self._offload, S.RELOAD: self._reload}
        with engine.no_sync():
            for action in self.actions:
                run[action.kind](action)
        state, self._step = self._step, None
        for pending, _ in state.sends:
            pending.wait()
        t0 = time.perf_counter()
        # shared parameters first, while every rank's gradient is whole and local: after the
        # dp reduction a ZeRO-1 rank holds reduced values only in its own shard, and the
        # shards of a tied embedding and head fall differently on the two stages
        self._sum_shared(engine)
        engine.sync_gradients()
        self._span("compute", "SYNC", "sync", t0)
        return state.loss_sum

    def _sum_shared(self, engine) -> None:
        # ZeRO-2/3 hold a pipelined step's gradients unreduced outside `.grad`
        grad_of = getattr(engine, "unreduced_grad", lambda p: p.grad)
        for p, shape in self.shared:  # the pp ranks without a copy add zeros
            grad = grad_of(p) if p is not None else torch.zeros(shape, device=self.mesh.device)
            comm.all_reduce(grad, self.mesh, "pp")

    # --- actions ----------------------------------------------------------------------------

    def _forward(self, a: S.Action) -> None:
        st, key = self._step, (a.microbatch, a.stage)
        x = st.batches[a.microbatch][0] if a.stage == 0 else self._received(st.recv_f, key)
        if a.stage > 0:
            x.requires_grad_(True)
            st.inputs[key] = x
        t0 = time.perf_counter()
        inputs = [x] if a.stage > 0 else []
        if self.recompute == "full" or key in self.schedule.recompute:
            st.rerun[key] = (x, _rng_state(self.mesh.device))
            with torch.no_grad(), self._saving(key, inputs):
                out = self._stage_forward(a, x, count=True)
        else:
            with self._saving(key, inputs):
                out = self._stage_forward(a, x, count=True)
        st.outputs[key] = out
        self._span("compute", S.F, str(a), t0)

    def _saving(self, key, inputs=()):
        if self.measure_activations or key in self.offloaded:
            return self.stash.saving(key, inputs)
        return contextlib.nullcontext()

    def _stage_forward(self, a: S.Action, x: torch.Tensor, count: bool) -> torch.Tensor:
        """Stage `a.stage`'s output for micro-batch `a.microbatch`; on the last stage the loss
        divided by the step's token count (added to the step's loss sum once, if `count`)."""
        st = self._step
        st.before(a.microbatch)
        out = self.stages[a.stage](x)
        if a.stage == self.last:
            loss = st.loss_fn(out, st.batches[a.microbatch][1])
            if count:
                st.loss_sum += loss.detach()
            out = loss / st.global_tokens
        return out

    def _backward(self, a: S.Action) -> None:
        st, key = self._step, (a.microbatch, a.stage)
        grad = None if a.stage == self.last else self._received(st.recv_b, key)
        t0 = time.perf_counter()
        out = st.outputs.pop(key)
        if key in st.rerun:  # recomputation: the forward again, with the same random numbers
            x, rng = st.rerun.pop(key)
            with _restored_rng(rng), self._saving(key):
                out = self._stage_forward(a, x, count=False)
        context = self.deferred.deferring(key) if a.kind == S.I else contextlib.nullcontext()
        with context:
            torch.autograd.backward(out, grad)
        if a.stage > 0:
            st.grads[key] = st.inputs.pop(key).grad
        if a.kind == S.B:
            self.stash.release(key)
        self._span("compute", a.kind, str(a), t0)

    def _weights(self, a: S.Action) -> None:
        t0 = time.perf_counter()
        key = (a.microbatch, a.stage)
        self.deferred.run(key)
        self.stash.release(key)
        self._span("compute", S.W, str(a), t0)

    def _send(self, a: S.Action) -> None:
        st, key = self._step, (a.microbatch, a.stage)
        if a.kind == S.SEND_F:
            tensor, to, what = st.outputs[key].detach(), a.stage + 1, _ACT
        else:
            tensor, to, what = st.grads.pop(key), a.stage - 1, _GRAD
        tensor = tensor.contiguous()
        issued = time.perf_counter()
        pending = comm.send(tensor, self.mesh, "pp", S.stage_rank(to, self.pp), async_op=True,
                            tag=self._tag(what, a.microbatch, to if what == _ACT else a.stage))
        st.sends.append((pending, tensor))  # the tensor must live until the send completes
        self._posted(a, issued)

    def _recv(self, a: S.Action) -> None:
        st, key = self._step, (a.microbatch, a.stage)
        if a.kind == S.RECV_F:
            sender, frm, what, table = a.stage - 1, a.stage - 1, _ACT, st.recv_f
        else:
            sender, frm, what, table = a.stage, a.stage + 1, _GRAD, st.recv_b
        buffer = self._buffer(sender, self._input_shape(a.microbatch))
        issued = time.perf_counter()
        pending = comm.recv(buffer, self.mesh, "pp", S.stage_rank(frm, self.pp), async_op=True,
                            tag=self._tag(what, a.microbatch, a.stage if what == _ACT else frm))
        table[key] = (buffer, pending, a, issued)

    def _input_shape(self, microbatch: int) -> torch.Size:
        """The first-stage input's shape of a step's micro-batch (every pp rank holds it)."""
        return self._step.batches[microbatch][0].shape

    def _buffer(self, stage: int, input_shape) -> torch.Tensor:
        """An empty tensor for stage `stage`'s output (or its gradient) on the micro-batch
        whose first-stage input has `input_shape` (None: the micro-batch `shapes` were
        found for)."""
        shape, dtype = self.shapes[stage]
        return torch.empty(output_shape(shape, self.sample_shape, input_shape), dtype=dtype,
                           device=self.mesh.device)

    def _offload(self, a: S.Action) -> None:
        t0 = time.perf_counter()
        self.stash.offload((a.microbatch, a.stage))
        self._span("copy", S.OFFLOAD, str(a), t0)

    def _reload(self, a: S.Action) -> None:
        t0 = time.perf_counter()
        self.stash.reload((a.microbatch, a.stage))
        self._span("copy", S.RELOAD, str(a), t0)

    def _received(self, table: dict, key) -> torch.Tensor:
        """The buffer of a posted receive, once it has arrived; the compute lane records the
        wait, the comm lane the receive from its posting to its arrival being seen here."""
        buffer, pending, a, issued = table.pop(key)
        t0 = time.perf_counter()
        pending.wait()
        if time.perf_counter() - t0 > 20e-6:
            self._span("compute", "WAIT", f"wait {key[0]}.{key[1]}", t0)
        self._span("comm", a.kind, str(a), issued)
        return buffer

    def _tag(self, what: int, microbatch: int, stage: int) -> int:
        """A message's tag: what it carries, for which micro-batch, into which stage (an
        activation is named by its receiving stage, a gradient by its sending stage)."""
        return (what * self.schedule.stages + stage) * max(self.schedule.microbatches, 1) + microbatch

    # --- timeline ---------------------------------------------------------------------------

    def _span(self, lane: str, kind: str, name: str, t0: float) -> None:
        if self.spans is not None:
            self.spans.append({"lane": lane, "kind": kind, "name": name, "start_s": t0,
                               "end_s": time.perf_counter()})

    def _posted(self, a: S.Action, issued: float) -> None:
        """A send's span: its posting (gloo reports a point-to-point completion only to the
        one thread that waits for it: `is_completed()` stays False until then, and a second
        waiter never returns, so a send's completion is not observable without blocking)."""
        self._span("comm", a.kind, str(a), issued)

    def gather_spans(self) -> list[dict]:
        """Every pp rank's recorded spans, on every pp rank: [{"rank", "spans"}], times in
        seconds from the earliest span of any rank (ranks on one host share the monotonic
        clock; across hosts the offsets between clocks are not corrected). Collective over pp."""
        spans, self.spans = self.spans or [], None
        rows = torch.tensor([[_LANES.index(s["lane"]), _KINDS.index(s["kind"]), *_where(s["name"]),
                              s["start_s"], s["end_s"]] for s in spans] or torch.empty(0, 6),
                            dtype=torch.float64).reshape(-1, 6)
        count = torch.tensor([len(rows)], dtype=torch.float64)
        comm.all_reduce(count, self.mesh, "pp", op="max")
        padded = torch.full((int(count), 6), -1.0, dtype=torch.float64)
        padded[:len(rows)] = rows
        out = torch.empty((self.pp, *padded.shape), dtype=torch.float64)
        comm.all_gather(out, padded, self.mesh, "pp")
        valid = out[..., 0] >= 0
        origin = float(out[..., 4][valid].min()) if valid.any() else 0.0
        ranks = []
        for r in range(self.pp):
            ranks.append({"rank": r, "spans": [_span_of(row, origin) for row in out[r].tolist()
                                               if row[0] >= 0]})
        return ranks

    # --- forward only (evaluation) ----------------------------------------------------------

    @torch.no_grad()
    def forward_only(self, x: torch.Tensor) -> torch.Tensor | None:
        """The model's output for `x` on the rank of the last stage (None elsewhere): stage
        after stage, each rank's stages in turn, blocking sends and receives."""
        out, given = None, x.shape
        for stage in range(self.schedule.stages):
            if S.stage_rank(stage, self.pp) != self.rank:
                continue
            if stage > 0:
                x = self._buffer(stage - 1, given)
                comm.recv(x, self.mesh, "pp", S.stage_rank(stage - 1, self.pp),
                          tag=self._tag(_EVAL, 0, stage))
            out = self.stages[stage](x)
            if stage < self.last:
                comm.send(out.contiguous(), self.mesh, "pp", S.stage_rank(stage + 1, self.pp),
                          tag=self._tag(_EVAL, 0, stage + 1))
        return out if self.rank == S.stage_rank(self.last, self.pp) else None


def output_shape(shape, sample_shape, input_shape) -> tuple:
    """A stage's output `shape`, found for a first-stage input of `sample_shape`, for an input
    of `input_shape`: its rows follow the input's (an evaluation's micro-batches), and so do
    its tokens, in the stage's proportion (1/tp of them under sequence parallelism), where
    an input has its own count (data.balance deals each rank its own tokens every
    micro-batch; every stage of a pipeline holds the same deal). Without `sample_shape`
    only the rows follow; without `input_shape`, nothing."""
    if input_shape is None:
        return tuple(shape)
    if sample_shape is None or len(shape) < 2 or len(input_shape) < 2:
        return (input_shape[0], *shape[1:])
    tokens, given = shape[1] * input_shape[1], sample_shape[1]
    if tokens % given:
        raise ValueError(f"a stage's output of {shape[1]} tokens for an input of {given} does "
                         f"not divide for an input of {input_shape[1]} tokens")
    return (input_shape[0], tokens // given, *shape[2:])


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _restored_rng(state: tuple):
    """The RNG as it was at `state` (a recomputed forward draws the same dropout masks); the
    RNG as it was before, afterwards."""
    cpu, cuda = state
    devices = [torch.cuda.current_device()] if cuda is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        yield


_LANES = ("compute", "comm", "copy")
_KINDS = (*S.KINDS, "WAIT", "SYNC")


def _where(name: str) -> tuple[float, float]:
    """(micro-batch, stage) of a span's name ("F3.1", "wait 3.1"), (-1, -1) for none."""
    tail = name.split(" ")[-1].lstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ_")
    m, _, s = tail.partition(".")
    return (float(m), float(s)) if m.isdigit() and s.isdigit() else (-1.0, -1.0)


def _span_of(row: list[float], origin: float) -> dict:
    lane, kind, m, s = _LANES[int(row[0])], _KINDS[int(row[1])], int(row[2]), int(row[3])
    name = {"WAIT": f"wait {m}.{s}", "SYNC": "sync"}.get(kind, f"{kind}{m}.{s}")
    return {"lane": lane, "kind": kind, "name": name, "start_s": row[4] - origin,
            "end_s": row[5] - origin}


def _check_stages(stages, shapes, schedule: S.Schedule, rank: int, pp: int) -> None:
    if not isinstance(stages, Mapping):
        raise TypeError(f"stages: a {{stage: module}} mapping (a split model's: "
                        f"PipelineModule.stage_modules()), got a {type(stages).__name__}")
    mine = [s for s in range(schedule.stages) if S.stage_rank(s, pp) == rank]
    if sorted(stages) != mine:
        raise ValueError(f"pp rank {rank} runs stages {mine} of the {schedule.stages} of "
                         f"schedule {schedule.name!r}; the stage modules given are for "
                         f"stages {sorted(stages)}")
    if len(shapes) < schedule.stages - 1:
        raise ValueError(f"shapes: one (shape, dtype) per stage that sends its output "
                         f"({schedule.stages - 1}), got {len(shapes)}")


class _StepState:
    def __init__(self, engine, batches, global_tokens, loss_fn, device, before=None):
        self.engine, self.batches, self.global_tokens, self.loss_fn = engine, batches, global_tokens, loss_fn
        self.before = before if before is not None else (lambda microbatch: None)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.inputs: dict = {}  # (m, s) -> the received input, whose .grad goes back
        self.outputs: dict = {}  # (m, s) -> what backward starts from (output or loss)
        self.grads: dict = {}  # (m, s) -> gradient of the input, to send
        self.recv_f: dict = {}  # (m, s) -> (buffer, pending, action, posted) of an input
        self.recv_b: dict = {}  # the same for an output gradient
        self.sends: list = []
        self.rerun: dict = {}  # (m, s) -> (input, RNG state) of a forward to recompute
