"""Shift Parallelism serving: the same loaded GPT serving a mixed request trace always
tensor-parallel ("tp"), always Ulysses sequence-parallel ("sp"), or switching per batch by
tokens in flight ("shift"), in the same world (inference/shift.py; arXiv 2509.16495).

    .venv/bin/python benchmarks/shift.py [--quick]

`measure_serving(rank, world, ...)` runs inside an already-initialized gloo world (every
rank calls it alike) and returns, on every rank, per policy:
- p50_latency_ms: the median over requests of the time from its group's prefill to its
  last token (static batching: a group is prefilled as one batch, then decoded together);
- tokens_per_s: generated tokens of the whole trace over the trace's wall time;
- prefill_ms, decode_ms: the trace's time in prefill steps and in decode steps;
all the slowest rank's, medians over rounds. The trace alternates small and large groups: 1
request with an 8-token prompt, then 8 requests with 64-token prompts, each generating
`new_tokens` greedy tokens. "shift" uses threshold_tokens 32: the large prefills (512
tokens) run sp, the small prefill (8) and every decode step (1 or 8 tokens) run tp. The
policies alternate in each round, reversed every other round, after an untimed warm-up
round. `greedy_match`: the fraction of each policy's tokens equal to tp's.

The model is the GPT at random init with its matrices scaled by 4 (as benchmarks/decode.py),
one torch thread per rank. main() spawns a world of 2 and prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
from worlds import World, free_port, tp_rank

from loomtrain import comm
from loomtrain.inference.shift import Request, ShiftServer
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT

POLICIES = {"tp": "tp", "sp": "sp", "shift": None}  # forced mode, or the threshold's choice
SMALL, LARGE = (1, 8), (8, 64)  # (requests, prompt tokens) of the trace's two group kinds
THRESHOLD_TOKENS = 32


def _trace(vocab: int, groups: int, new_tokens: int) -> list[list[Request]]:
    gen = torch.Generator().manual_seed(1)
    trace = []
    for g in range(groups):
        count, length = SMALL if g % 2 == 0 else LARGE
        prompts = torch.randint(0, vocab, (count, length), generator=gen)
        trace.append([Request(p, new_tokens) for p in prompts])
    return trace


def _serve(server, trace, mode, mesh) -> tuple[torch.Tensor, list]:
    """(the slowest rank's [wall, prefill, decode, per-group latencies...] in s; tokens)."""
    comm.barrier(mesh, "tp")
    start = time.perf_counter()
    served = server.serve(trace, mode)
    wall = time.perf_counter() - start
    first, at = set(), 0  # index of each group's prefill step among the steps
    for group in trace:
        first.add(at)
        at += max(r.new_tokens for r in group)
    prefill = sum(s for i, (_m, _n, s) in enumerate(served.steps) if i in first)
    decode = sum(s for i, (_m, _n, s) in enumerate(served.steps) if i not in first)
    figures = torch.tensor([wall, prefill, decode, *served.group_latency_s], dtype=torch.float64)
    comm.all_reduce(figures, mesh, "tp", op="max")
    return figures, served.tokens


def measure_serving(rank: int, world: int, mesh=None, d_model: int = 256, n_layers: int = 4,
                    n_heads: int = 8, vocab: int = 256, quick: bool = False) -> dict:
    """Latency and throughput of the three policies on one trace; see the module docstring.
    `mesh` must have a tp axis of size `world` (built here if None)."""
    mesh = mesh or build_mesh({"tp": world})
    groups, new_tokens, rounds = (2, 4, 1) if quick else (4, 16, 5)
    torch.manual_seed(0)  # the same weights on every rank
    model = GPT(vocab, LARGE[1] + new_tokens, d_model, n_layers, n_heads).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    server = ShiftServer(model, mesh, THRESHOLD_TOKENS)
    trace = _trace(vocab, groups, new_tokens)
    per_request = [len(g) for g in trace]
    generated = sum(r.new_tokens for g in trace for r in g)
    runs: dict[str, list] = {name: [] for name in POLICIES}
    tokens = {}
    for r in range(rounds + 1):
        for name in (list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))):
            figures, tokens[name] = _serve(server, trace, POLICIES[name], mesh)
            if r:  # round 0 warms up
                runs[name].append(figures)
    out = {}
    for name, figs in runs.items():
        latencies = [statistics.median(float(f[3 + g]) for f in figs)
                     for g, n in enumerate(per_request) for _ in range(n)]
        wall = statistics.median(float(f[0]) for f in figs)
        agree = [torch.equal(a, b) for a, b in zip(tokens[name], tokens["tp"])]
        out[name] = {"p50_latency_ms": 1e3 * statistics.median(latencies),
                     "tokens_per_s": generated / wall,
                     "prefill_ms": 1e3 * statistics.median(float(f[1]) for f in figs),
                     "decode_ms": 1e3 * statistics.median(float(f[2]) for f in figs),
                     "greedy_match": sum(agree) / len(agree)}
    out["config"] = {"world": world, "d_model": d_model, "n_layers": n_layers,
                     "n_heads": n_heads, "vocab": vocab, "groups": groups,
                     "small_group": SMALL, "large_group": LARGE, "new_tokens": new_tokens,
                     "threshold_tokens": THRESHOLD_TOKENS, "rounds": rounds,
                     "threads": torch.get_num_threads()}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 groups, 4 new tokens, 1 round")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    world = World("shift", 2, tp_rank, (2, free_port(), measure_serving), timeout_s=600)
    try:
        result = world.command({"quick": args.quick})[0]
        world.close()
    except BaseException:
        world.kill()
        raise
    out = {"benchmark": "shift", "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "cpus": os.cpu_count(),
           "wall_s": round(time.perf_counter() - t0, 1), **result}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
