"""The measurements behind `loom bench calibrate` (calibrate.py turns them into `cpu-here`): four
gloo processes on 127.0.0.1, a mesh dp=2 x tp=2, timing GEMMs, attention, memory bandwidth,
operator overhead, all-reduces and sends, and the penalty of a collective between two GEMMs.
What each figure is and how it is taken: docs/planner-calibrate.md.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

WORLD = 4
PROCS = (1, 2, 4)  # processes computing at once in the matmul measurement
# The default model (presets "default": h 256, r 4) at train.micro_batch 8 x seq_len 128 =
# 1024 tokens per microbatch: a block's qkv, proj, fc and fc-proj GEMMs as (m, k, n). The
# cost model charges every matmul FLOP at one rate, so this mix is the rate it should use.
TOKENS, H, R = 1024, 256, 4
MODEL_GEMMS = ((TOKENS, H, 3 * H), (TOKENS, H, H), (TOKENS, H, R * H), (TOKENS, R * H, H))
LARGE_GEMMS = ((1024, 1024, 1024),)  # the machine's best rate: peak_*_flops
# the default model's attention core at micro_batch 8: (batch, heads, seq, head dim)
ATTENTION = (8, 4, 128, 64)
# the sync penalty's compute between two collectives: a block's qkv and proj GEMMs forward
CHUNK = MODEL_GEMMS[:2]
PENALTY_BYTES = (4, 64 * 1024, 1 << 20)


@dataclass(frozen=True)
class Effort:
    """How much to measure. message_bytes: all-reduce and send sizes; reps: repetitions per
    figure (medians over them); window_s: how long each matmul figure runs, in `reps` slices
    (with n processes, all n at once); stream_elems: fp32 elements of each tensor of the add."""
    message_bytes: tuple[int, ...]
    reps: int
    window_s: float
    stream_elems: int


KIB, MIB = 1 << 10, 1 << 20
# stream tensors of 64 MiB and more: past the 32 MiB L3 (measured here: an add of 4 MiB
# tensors runs at 118 GB/s, of 16 MiB at 72, of 64 and 256 MiB at 46-47)
FULL = Effort((4, 64, KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB), reps=15,
              window_s=6.0, stream_elems=32 * MIB)
QUICK = Effort((4, KIB, 64 * KIB, MIB, 16 * MIB), reps=3, window_s=0.75, stream_elems=16 * MIB)


def measure(effort: Effort) -> dict:
    """The raw figures (see `_rank_main`), from four spawned gloo processes, and the 1-minute
    load average before them: other processes on the cores slow every figure down."""
    import torch.multiprocessing as mp

    load = os.getloadavg()[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="loom-calibrate-") as tmp:
        mp.spawn(_rank_main, args=(port, effort, tmp), nprocs=WORLD, join=True)
        found = json.loads((Path(tmp) / "found.json").read_text())
    found["message_bytes"] = list(effort.message_bytes)
    found["load_average"] = load
    return found


def _rank_main(rank: int, port: int, effort: Effort, out_dir: str) -> None:
    """One of the WORLD ranks; rank 0 writes every figure to out_dir/found.json."""
    import torch
    import torch.distributed as dist

    from loomtrain import comm
    from loomtrain.mesh import build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    mesh = build_mesh({"dp": 2, "tp": 2})  # "tp": the pairs {0, 1} and {2, 3}; "world": all four
    cores = os.cpu_count() or 1
    found: dict = {}
    slice_s = effort.window_s / effort.reps
    if rank == 0:
        torch.set_num_threads(cores)  # one process alone gets every core (train/launch.py)
        large = {"fp32": _gemms(LARGE_GEMMS, torch.float32), "bf16": _gemms(LARGE_GEMMS, torch.bfloat16)}
        rates = {name: [] for name in large}
        for r in range(effort.reps):  # alternated, so a drift in load falls on both alike
            for name in list(large)[:: 1 if r % 2 == 0 else -1]:
                rates[name].append(_gemm_flops(*large[name], slice_s))
        for name, got in rates.items():
            found[f"large_{name}_flops"] = statistics.median(got)
        found["stream_bytes_per_s"] = _stream_bytes_per_s(effort.stream_elems, effort.reps)
        found["op_overhead_s"] = _op_overhead_s(effort.reps)
        found["attention_efficiency"] = _attention_efficiency(slice_s, effort.reps)
    # k processes at once, k in PROCS, in rounds of alternating order (1 2 4, 4 2 1, ...)
    mine: dict[int, list[float]] = {k: [] for k in PROCS}
    model = _linears(MODEL_GEMMS)
    for r in range(effort.reps):
        for k in PROCS[:: 1 if r % 2 == 0 else -1]:
            torch.set_num_threads(max(1, cores // k))  # what loom train gives each of k ranks
            comm.barrier(mesh)
            if rank < k:
                mine[k].append(_gemm_flops(*model, slice_s))
    found["flops_by_procs"] = []
    for k in PROCS:
        rates = torch.zeros(WORLD, dtype=torch.float64)
        if rank < k:
            rates[rank] = statistics.median(mine[k])
        comm.all_reduce(rates, mesh, "world")
        found["flops_by_procs"].append((k, rates[:k].mean().item()))  # k x this = the aggregate
    torch.set_num_threads(max(1, cores // 2))
    penalty = []  # (processes running, n, seconds)
    if rank < 2:
        found["all_reduce_s_2"] = _all_reduce_s(mesh, "tp", effort)
        found["send_s"] = _send_s(mesh, effort)
        penalty.append((2, 2, _sync_penalty_s(mesh, "tp", effort.reps)))
        shift = [(2, _shift_exposed_s(mesh, "tp", effort.reps))]
    comm.barrier(mesh)
    torch.set_num_threads(max(1, cores // WORLD))
    found[f"all_reduce_s_{WORLD}"] = _all_reduce_s(mesh, "world", effort)
    penalty.append((WORLD, 2, _sync_penalty_s(mesh, "tp", effort.reps)))
    penalty.append((WORLD, WORLD, _sync_penalty_s(mesh, "world", effort.reps)))
    found["sync_penalty"] = penalty
    exposed = _shift_exposed_s(mesh, "tp", effort.reps)  # both pairs at once
    if rank < 2:
        found["shift_exposed_s"] = [*shift, (WORLD, exposed)]
    if rank == 0:
        (Path(out_dir) / "found.json").write_text(json.dumps(found))
    comm.barrier(mesh)  # before destroy: avoids the intermittent abort at exit (DESIGN.md)
    dist.destroy_process_group()


def _gemms(shapes, dtype) -> tuple[list, int]:
    """Operands for the GEMMs (m, k, n), run once (warm-up), and their FLOPs."""
    import torch

    pairs = [(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)) for m, k, n in shapes]
    for a, b in pairs:
        a @ b
    return pairs, sum(2 * m * k * n for m, k, n in shapes)


def _linears(shapes) -> tuple[list, int]:
    """F.linear layers (tokens m, in k, out n) as training runs them, forward and backward
    (three GEMMs each), as a list of one-call closures, run once (warm-up), and their FLOPs."""
    import torch
    import torch.nn.functional as F

    def layer(m, k, n):
        x = torch.randn(m, k, requires_grad=True)
        w, b = torch.randn(n, k, requires_grad=True), torch.zeros(n, requires_grad=True)
        grad = torch.ones(m, n)
        return lambda: F.linear(x, w, b).backward(grad)

    calls = [layer(*shape) for shape in shapes]
    for call in calls:
        call()
    return calls, sum(6 * m * k * n for m, k, n in shapes)


def _attention_efficiency(seconds: float, reps: int) -> float:
    """The attention core's rate (torch's causal scaled_dot_product_attention, forward and
    backward, its FLOPs counted as cost.py counts them: 4 s h per token forward over the full
    square, 3x for both) over the default model's linear layers' rate, alternated."""
    import torch
    import torch.nn.functional as F

    b, heads, s, d = ATTENTION
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    grad = torch.ones(b, heads, s, d)

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    attention()
    pieces = {"attention": ([attention], 3 * b * s * 4 * s * heads * d), "linear": _linears(MODEL_GEMMS)}
    rates = {name: [] for name in pieces}
    for r in range(max(reps, 3)):
        for name in list(pieces)[:: 1 if r % 2 == 0 else -1]:
            rates[name].append(_gemm_flops(*pieces[name], seconds / 2))
    return statistics.median(rates["attention"]) / statistics.median(rates["linear"])


def _gemm_flops(pairs, flops: int, seconds: float) -> float:
    """FLOP/s of the GEMMs run back to back for `seconds` (at least once): the FLOPs done over
    the time taken. Not a median over single repetitions: with more processes than cores the
    scheduler runs each for whole time slices, and a single repetition would mostly find a
    core to itself."""
    t0 = time.perf_counter()
    done, now = 0, t0
    while now - t0 < seconds or done < 1:
        for pair in pairs:
            pair() if callable(pair) else pair[0] @ pair[1]
        done, now = done + 1, time.perf_counter()
    return done * flops / (now - t0)


def _stream_bytes_per_s(elems: int, reps: int) -> float:
    """c = a + b over fp32 tensors far larger than the caches: 3 x 4 bytes per element."""
    import torch

    a, b, c = torch.randn(elems), torch.randn(elems), torch.empty(elems)
    torch.add(a, b, out=c)
    times = []
    for _ in range(max(reps, 3)):
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 12 * elems / statistics.median(times)


def _op_overhead_s(reps: int, iters: int = 200) -> float:
    """The fixed cost of one operator as the cost model charges it: a forward op costs one
    overhead forward and two backward (input and weight gradient), so a chain of tiny ops
    (layer norm, linear, GELU, linear, residual add, sum) run forward and backward under
    autograd costs 3 x 6 overheads, Python and dispatch included."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(1, 2, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    ops = 6

    def chain():
        y = F.linear(F.gelu(F.linear(F.layer_norm(x, (8,)), w1)), w2) + x
        y.sum().backward()

    chain()
    per_op = []
    for _ in range(max(reps, 3)):
        t0 = time.perf_counter()
        for _ in range(iters):
            chain()
        per_op.append((time.perf_counter() - t0) / (iters * 3 * ops))
    return statistics.median(per_op)


def _timed_s(call, mesh, axis: str, iters: int) -> float:
    """Seconds per call of `iters` back-to-back calls between two barriers, the slowest rank's
    (an op ends when its last rank does)."""
    import torch

    from loomtrain import comm

    comm.barrier(mesh, axis)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    took = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    comm.all_reduce(took, mesh, axis, op="max")
    return took.item()


def _iters(size: int) -> int:
    return max(1, min(20, MIB // max(size, 1)))  # small messages: several calls per timing


def _all_reduce_s(mesh, axis: str, effort: Effort) -> list[float]:
    """Median seconds of one all-reduce over `axis`, per message size (zeros: sums stay finite)."""
    import torch

    from loomtrain import comm

    out = []
    for size in effort.message_bytes:
        x = torch.zeros(max(1, size // 4))
        comm.all_reduce(x, mesh, axis)  # warm-up: first-call allocations
        out.append(statistics.median(
            _timed_s(lambda: comm.all_reduce(x, mesh, axis), mesh, axis, _iters(size))
            for _ in range(effort.reps)))
    return out


def _send_s(mesh, effort: Effort) -> list[float]:
    """Median one-way seconds of a send between the pair: half a ping-pong's round trip."""
    import torch

    from loomtrain import comm

    me = mesh.local_rank("tp")
    out = []
    for size in effort.message_bytes:
        x = torch.zeros(max(1, size // 4))

        def round_trip():
            if me == 0:
                comm.send(x, mesh, "tp", 1)
                comm.recv(x, mesh, "tp", 1)
            else:
                comm.recv(x, mesh, "tp", 0)
                comm.send(x, mesh, "tp", 0)

        round_trip()
        out.append(statistics.median(
            _timed_s(round_trip, mesh, "tp", _iters(size)) for _ in range(effort.reps)) / 2)
    return out


def _sync_penalty_s(mesh, axis: str, reps: int, iters: int = 8) -> float:
    """Seconds one all-reduce over `axis` adds between compute beyond its back-to-back time:
    per message size of PENALTY_BYTES, `iters` x (CHUNK's GEMMs, then the all-reduce) less
    `iters` x the GEMMs alone less `iters` x the all-reduce alone, each the slowest rank's, in
    alternating order; the median over the sizes (the penalty does not grow with the size:
    measured), never below 0. Every rank of the mesh not on `axis`'s groups must call this too
    when they compute at once (the processes running are part of what is measured)."""
    import torch

    from loomtrain import comm

    found = []
    for size in PENALTY_BYTES:
        x = torch.zeros(max(1, size // 4))
        mid = _in_context(mesh, axis, reps, iters, lambda: None,
                          lambda _: comm.all_reduce(x, mesh, axis))
        found.append(mid["both"] - mid["compute"] - mid["comm"])
    return max(0.0, statistics.median(found))


def _shift_exposed_s(mesh, axis: str, reps: int, iters: int = 8) -> list[float]:
    """Per message size of PENALTY_BYTES: the seconds a ring shift over `axis` of two tensors
    of half the size each adds to CHUNK's GEMMs when it runs as ring attention runs it
    (parallel/sequence/ring.py: started, the compute, then waited for), over the GEMMs alone.
    calibrate.py keeps what exceeds the fitted send time as `shift_penalty`."""
    import torch

    from loomtrain.parallel.sequence.context import Ring

    ring = Ring(mesh, axis)
    found = []
    for size in PENALTY_BYTES:
        sends = [torch.zeros(max(1, size // 8)) for _ in range(2)]
        recvs = [torch.empty_like(t) for t in sends]

        def start():
            return ring.shift(sends, recvs)

        def wait(pending):
            for p in pending:
                p.wait()

        mid = _in_context(mesh, axis, reps, iters, start, wait)
        found.append(max(0.0, mid["both"] - mid["compute"]))
    return found


def _in_context(mesh, axis: str, reps: int, iters: int, start, finish) -> dict[str, float]:
    """Median seconds per iteration of `start()`, CHUNK's GEMMs, `finish(what start returned)`
    ("both"), of the GEMMs alone ("compute") and of start and finish back to back ("comm"),
    each timed by `_timed_s` (the slowest rank of `axis`), in alternating order."""
    import torch

    pairs, _ = _gemms(CHUNK, torch.float32)

    def compute():
        for a, b in pairs:
            a @ b

    def both():
        begun = start()
        compute()
        finish(begun)

    loops = {"both": both, "compute": compute, "comm": lambda: finish(start())}
    times = {name: [] for name in loops}
    both()
    for r in range(max(reps, 3)):
        for name in list(loops)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(_timed_s(loops[name], mesh, axis, iters))
    return {name: statistics.median(t) for name, t in times.items()}
