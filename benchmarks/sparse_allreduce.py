"""Sparse all-reduce, allgather against balanced (Zen), with the dense all-reduce as the peer,
across a simulated 1 Gbit/s link.

    .venv/bin/python benchmarks/sparse_allreduce.py [--reps 7] [--numel 4194304] [--gbps 1]
                                                    [--quick]

World 4, spawned on 127.0.0.1 (gloo, one torch thread per rank), as 2 simulated nodes of 2
ranks with a 1 Gbit/s (--gbps), 1 ms per op link between them (comm/link.py: an op across nodes is not
complete before latency + its wire bytes over the bandwidth). The tensor is a gradient bucket
of `numel` fp32 values (default 2^22, 16 MiB). Each rank's sparse gradient holds
density x numel distinct indices drawn with probability ~ 1/(i + 1)^1.2 over the whole index
space (a power law: an embedding's hot rows, a top-k's large entries), from a seed of its own,
so the ranks share most of their hot indices and few of their tail ones; values N(0, 1).

For each density (0.001, 0.01, 0.1) the variants alternate over `reps` repetitions (A B C,
C B A, ...); a repetition starts every rank together (a barrier off the link) and keeps the
slowest rank's seconds; time_s is the median. Variants: `sparse_all_reduce`
(comm/sparse.py) with scheme "allgather" and "balanced", and "dense": scatter into a zeroed
tensor, then `comm.all_reduce` of all numel values. bytes: the wire bytes one rank sent, the
largest over ranks (the sparse result's count, which the tests check against the meter; the
meter's for dense). link_s: what the simulated link alone takes for those bytes (latency +
bytes / bandwidth per op, comm/link.py), the largest over ranks; time_s - link_s is roughly
what the ranks' own work and the real transfers added on this machine (4 ranks on its cores).
Also: the scheme "auto" picks, the union u / numel, the formats the owners' sums travelled
in, and a check that both schemes give the same bits, within fp32 rounding of the dense sum.

The last line on stdout is one JSON object; its target: balanced faster than allgather at 10%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
from worlds import World, closing_worlds, free_port, joined_world

from loomtrain import comm
from loomtrain.comm.link import SlowLink
from loomtrain.comm.sparse import sparse_all_reduce
from loomtrain.mesh import build_mesh

WORLD, RANKS_PER_NODE, LATENCY_MS = 4, 2, 1.0
DENSITIES = (0.001, 0.01, 0.1)
VARIANTS = ("allgather", "balanced", "dense")


def _gradient(rank: int, numel: int, density: float, weights: torch.Tensor):
    g = torch.Generator().manual_seed(1000 + rank)
    indices = torch.multinomial(weights, round(density * numel), generator=g)
    return indices, torch.randn(indices.numel(), generator=g)


def _off_link(mesh, fn):
    """Run `fn` with the simulated link off: the benchmark's own synchronization is not timed."""
    link, mesh.link = mesh.link, None
    try:
        return fn()
    finally:
        mesh.link = link


def _max_over_ranks(mesh, x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    _off_link(mesh, lambda: comm.all_reduce(t, mesh, "dp", op="max"))
    return t.item()


def _timed(mesh, call) -> float:
    _off_link(mesh, lambda: comm.barrier(mesh))
    t0 = time.perf_counter()
    call()
    return _max_over_ranks(mesh, time.perf_counter() - t0)


def _calls(indices, values, numel: int, mesh) -> dict:
    """Each variant as a call returning (the summed tensor, what it did)."""
    def sparse(scheme):
        def call():
            out = torch.empty(numel)
            return out, sparse_all_reduce(indices, values, out, mesh, "dp", scheme)
        return call

    def dense():
        before = mesh.meter.total()
        out = torch.zeros(numel)
        out[indices] = values
        comm.all_reduce(out, mesh, "dp")
        return out, mesh.meter.total() - before
    return {"allgather": sparse("allgather"), "balanced": sparse("balanced"), "dense": dense}


def _measure_density(mesh, rank: int, numel: int, density: float, reps: int, weights) -> dict:
    indices, values = _gradient(rank, numel, density, weights)
    calls = _calls(indices, values, numel, mesh)
    done, link_s = {}, {}
    for v in VARIANTS:  # also the warm-up: first allocations, the owners' layout
        mesh.meter.take_simulated()
        done[v] = calls[v]()
        link_s[v] = mesh.meter.take_simulated()["total"]
    times = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            times[v].append(_timed(mesh, calls[v]))
    (ag, ag_result), (bal, bal_result), (dense, dense_bytes) = (done[v] for v in VARIANTS)
    sent = {"allgather": ag_result.wire_bytes, "balanced": bal_result.wire_bytes,
            "dense": dense_bytes}
    auto = sparse_all_reduce(indices, values, torch.empty(numel), mesh, "dp").scheme
    agree = torch.equal(ag, bal) and torch.allclose(bal, dense, rtol=1e-5, atol=1e-6)
    return {
        "figures": {v: {"bytes": int(_max_over_ranks(mesh, sent[v])),
                        "time_s": round(statistics.median(times[v]), 4),
                        "link_s": round(_max_over_ranks(mesh, link_s[v]), 4)} for v in VARIANTS},
        "auto": auto, "union_fraction": round(bal_result.union_pairs / numel, 4),
        "owner_formats": sorted(set(bal_result.owner_formats)),
        "agree": _max_over_ranks(mesh, 0.0 if agree else 1.0) == 0.0,
    }


def _rank(rank, world, port, gbps, commands, results) -> None:
    with joined_world(rank, world, port):
        link = SlowLink(gbps, LATENCY_MS, RANKS_PER_NODE)
        mesh = build_mesh({"dp": world}, ranks_per_node=RANKS_PER_NODE, link=link)
        while (config := commands[rank].get()) is not None:
            numel, densities, reps = config
            weights = 1.0 / torch.arange(1, numel + 1, dtype=torch.float64) ** 1.2
            results.put((rank, {str(d): _measure_density(mesh, rank, numel, d, reps, weights)
                                for d in densities}))
        _off_link(mesh, lambda: comm.barrier(mesh))  # before destroy (DESIGN.md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--gbps", type=float, default=1.0, help="the simulated link's Gbit/s")
    parser.add_argument("--quick", action="store_true", help="2^18 values, 2 reps: a smoke run")
    args = parser.parse_args()
    numel, reps = (1 << 18, 2) if args.quick else (args.numel, args.reps)
    t0 = time.perf_counter()
    worlds = {"sparse": World("sparse", WORLD, _rank, (WORLD, free_port(), args.gbps),
                             timeout_s=900)}
    with closing_worlds(worlds):
        by_density = worlds["sparse"].command((numel, DENSITIES, reps))[0]
    table = {v: {d: row["figures"][v] for d, row in by_density.items()} for v in VARIANTS}
    for d, row in by_density.items():
        print(f"density {d:>6}: " + "  ".join(
            f"{v} {row['figures'][v]['time_s'] * 1e3:7.1f} ms {row['figures'][v]['bytes']:>10} B"
            for v in VARIANTS) + f"  auto {row['auto']}  u/numel {row['union_fraction']}",
            flush=True)
    print(json.dumps({
        "benchmark": "sparse_allreduce", "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "cpus": os.cpu_count(), "world": WORLD, "numel": numel,
        "dtype": "float32", "reps": reps, "quick": args.quick,
        "link": {"inter_node_gbps": args.gbps, "inter_node_latency_ms": LATENCY_MS,
                 "ranks_per_node": RANKS_PER_NODE},
        "sparse_allreduce": table,
        **{key: {d: row[key] for d, row in by_density.items()}
           for key in ("auto", "union_fraction", "owner_formats")},
        "schemes_agree": all(row["agree"] for row in by_density.values()),
        "targets": {"balanced_faster_than_allgather_at_0.1":
                    table["balanced"]["0.1"]["time_s"] < table["allgather"]["0.1"]["time_s"]},
        "wall_s": round(time.perf_counter() - t0, 1),
    }))


if __name__ == "__main__":
    main()
