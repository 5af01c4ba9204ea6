"""Native gloo reduce-scatter, all-gather and all-to-all against loomtrain's send/recv rings.

    .venv/bin/python benchmarks/collectives.py [--worlds 2 4] [--reps 7] [--quick]

For each world (spawned on 127.0.0.1, gloo, one torch thread per rank, as the tests run) and
each message size from 4 KiB to 16 MiB (fp32; the size is the op's payload: all-gather's
gathered output, reduce-scatter's and all-to-all's input), every variant is timed `reps`
times. A repetition times `iters` back-to-back calls between two barriers (more calls for
small messages, so one repetition lasts a few ms at least) and keeps the slowest rank's time
per call; the variants alternate inside each repetition, in reversed order every other one
(A B C, C B A, ...), so a drift in machine load falls on all of them alike. Figures are
medians over repetitions.

Variants: `native` is `comm.<op>(impl="native")` (gloo's `*_single` API), `ring` is
`comm.<op>(impl="ring")` (comm/ring.py); `native_list` is gloo's list-based API, called
directly, for all-gather and reduce-scatter.

It also measures what each variant really sends: the growth of `wchar` in /proc/self/io (the
bytes this process handed to write()/writev(), which is how gloo's TCP transport sends) over
one call of 4 MiB, divided by the payload. That is the check of the wire-byte formulas:
2(N-1)/N for an all-reduce, (N-1)/N for the others (docs/comm.md).

The last line on stdout is one JSON object: per (op, world, size) native_ms, ring_ms,
native_list_ms where measured, and ratio = ring_ms / native_ms (below 1: the ring is faster),
plus the measured wire factors.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loomtrain import comm
from loomtrain.mesh import build_mesh

SIZES_BYTES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
WIRE_PROBE_BYTES = 4 << 20
OPS = {
    "reduce_scatter": ("native", "native_list", "ring"),
    "all_gather": ("native", "native_list", "ring"),
    "all_to_all": ("native", "ring"),
}


def _call(op: str, variant: str, tensors, mesh):
    """One call of `variant` of `op` on the "dp" axis (the whole world)."""
    big, small, other = tensors
    n = mesh.size("dp")
    if op == "reduce_scatter":
        if variant == "native_list":  # the list API, measured beside the single-tensor one
            return dist.reduce_scatter(small, list(big.chunk(n)), group=mesh.group("dp"))
        return comm.reduce_scatter(small, big, mesh, "dp", impl=variant)
    if op == "all_gather":
        if variant == "native_list":
            return dist.all_gather(list(big.chunk(n)), small, group=mesh.group("dp"))
        return comm.all_gather(big, small, mesh, "dp", impl=variant)
    return comm.all_to_all(other, big, mesh, "dp", impl=variant)


def _tensors(size_bytes: int, n: int):
    numel = size_bytes // 4
    return torch.randn(numel), torch.randn(numel // n), torch.empty(numel)


def _timed_ms(op, variant, tensors, mesh, iters: int) -> float:
    comm.barrier(mesh)
    t0 = time.perf_counter()
    for _ in range(iters):
        _call(op, variant, tensors, mesh)
    elapsed = torch.tensor([(time.perf_counter() - t0) * 1e3 / iters])
    comm.all_reduce(elapsed, mesh, "world", op="max")  # the op ends when its slowest rank does
    return elapsed.item()


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _wire_factor(op, variant, mesh) -> float:
    """Bytes this rank wrote during one call, over the payload, averaged over ranks."""
    tensors = _tensors(WIRE_PROBE_BYTES, mesh.size("dp"))
    _call(op, variant, tensors, mesh)
    comm.barrier(mesh)
    before = _wchar()
    _call(op, variant, tensors, mesh)
    factor = torch.tensor([(_wchar() - before) / WIRE_PROBE_BYTES])
    comm.all_reduce(factor, mesh, "world")
    return round(factor.item() / mesh.world, 4)


def _rank_main(rank, world, port, sizes, reps, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    mesh = build_mesh({"dp": world})
    figures, wire = [], {}
    for op, variants in OPS.items():
        wire[op] = {v: _wire_factor(op, v, mesh) for v in variants}
        for size in sizes:
            tensors = _tensors(size, world)
            iters = max(1, min(32, (2 << 20) // size))
            for v in variants:  # warm-up: first-call allocations, connection set-up
                _call(op, v, tensors, mesh)
            times = {v: [] for v in variants}
            for rep in range(reps):
                for v in variants if rep % 2 == 0 else variants[::-1]:
                    times[v].append(_timed_ms(op, v, tensors, mesh, iters))
            row = {"op": op, "world": world, "size_bytes": size}
            row.update({f"{v}_ms": round(statistics.median(t), 4) for v, t in times.items()})
            row["ratio"] = round(row["ring_ms"] / row["native_ms"], 3)
            figures.append(row)
    comm.barrier(mesh)  # before destroy: avoids the intermittent abort at exit (DESIGN.md)
    if rank == 0:
        queue.put((figures, wire))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, sizes, reps: int):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, sizes, reps, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 600
    while True:  # poll, so a rank that dies fails the run now instead of at the deadline
        try:
            result = queue.get(timeout=1.0)
            break
        except Exception:  # queue.Empty
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"world {world}: a rank failed or hung (see its traceback)")
    for p in procs:
        p.join(timeout=30)
        if p.exitcode != 0:
            raise RuntimeError(f"world {world}: a rank exited with {p.exitcode}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 sizes, 3 reps: a smoke run")
    args = parser.parse_args()
    sizes = SIZES_BYTES[::3] if args.quick else SIZES_BYTES
    reps = 3 if args.quick else args.reps
    t0 = time.perf_counter()
    figures, wire = [], {}
    for world in args.worlds:
        rows, wire[world] = run_world(world, sizes, reps)
        figures.extend(rows)
        for r in rows:
            print(f"world {world} {r['op']:>14} {r['size_bytes'] >> 10:>6} KiB  native "
                  f"{r['native_ms']:8.3f} ms  ring {r['ring_ms']:8.3f} ms  ring/native "
                  f"{r['ratio']:.2f}", flush=True)
        print(f"world {world} bytes written per payload byte (4 MiB): {wire[world]}", flush=True)
    print(json.dumps({
        "benchmark": "collectives", "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "reps": reps, "cpus": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t0, 1), "figures": figures,
        "wire_factor_measured": wire,
    }))


if __name__ == "__main__":
    main()
