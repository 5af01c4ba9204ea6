"""Context parallelism: how long a sequence trains in a fixed memory budget, how fast, and
what travels; loomtrain's ring attention, Ulysses and LASP, against torch's own context
parallel where it runs.

    .venv/bin/python benchmarks/sequence.py [--budget-mb 48] [--length 2048] [--rounds 3]
    .venv/bin/python benchmarks/sequence.py --small     # smoke test: small budget, one round

One gloo world per cp degree (1, 2, 4) of spawned ranks on 127.0.0.1, one torch thread each.
The model: loomtrain's GPT (d_model 32, 4 heads, 2 layers, vocab 256, room for 32,768
positions, the longest row searched), softmax attention for ring and Ulysses, linear attention with decay for LASP
(`model.attention = "linear"`), one row of random tokens per step, fp32, AdamW.

- `max_seq_len[method][cp]`: the longest row (a multiple of 64) whose training step (forward,
  backward) keeps every rank's peak of live tensor bytes within `--budget-mb`. The peak is the
  allocator's own count: torch.profiler's memory events (profile_memory=True) summed in time
  order over the step, the gradients already allocated by an earlier step. Doubling from 512,
  then bisection; a method that fits the longest row gets the cap, 32768. At cp = 1 each
  method runs its own kernel alone (ring: the tiled kernel, Ulysses: SDPA, LASP: the chunked
  linear kernel).
- `tokens_per_s[method]` at `--length` and cp = 2: steps timed from a barrier on every rank,
  the slowest rank's time; rounds alternate the methods, medians over rounds. `cp1` is the
  same step on one rank (cp = 1, SDPA), the peer for what splitting costs.
- `bytes_per_step[method]`: wire bytes one rank sends in that step (the CommMeter; the
  gradient all-reduce over cp, the same for every method, is left out of these steps), and
  `lasp_bytes_per_layer[T]` against `ring_bytes_per_layer[T]`: one attention layer's forward
  and backward at cp = 2, for T from 1k to 16k tokens.
- `torch_context_parallel`: torch.distributed.tensor.experimental.context_parallel on the
  same attention at cp = 2, its outcome and error text if it fails (on CPU it does in 2.13:
  docs/sequence.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from worlds import World, closing_worlds, free_port, joined_world

from loomtrain import comm
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, token_loss_sum

MODEL = {"vocab_size": 256, "seq_len": 32768, "d_model": 32, "n_layers": 2, "n_heads": 4}
METHODS = {"ring": "softmax", "ulysses": "softmax", "lasp": "linear"}
GRANULE = 64  # lengths searched: multiples of 2 x cp for every cp here


class Runner:
    """One rank's model for one method, trained on rows of any length."""

    def __init__(self, mesh, method: str):
        from loomtrain.parallel.sequence import SequenceRuntime

        torch.manual_seed(0)
        linear = METHODS[method] == "linear"
        self.model = GPT(**MODEL, attention=METHODS[method], linear_decay=linear)
        self.mesh, self.method = mesh, method
        # at cp = 1 the ring has one member: the method's own kernel on the whole row
        self.runtime = SequenceRuntime(self.model, mesh, method, METHODS[method])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.step(512)  # gradients and optimizer state exist before anything is measured

    def step(self, length: int) -> None:
        g = torch.Generator().manual_seed(length)
        row = torch.randint(0, MODEL["vocab_size"], (1, length + 1), generator=g)
        x, y = self.runtime.shard(row[:, :-1], row[:, 1:])
        loss = token_loss_sum(self.model(x), y) / length
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def peak_bytes(self, length: int) -> int:
        """The step's peak of live tensor bytes on this rank (allocator events, in order)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step(length)
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        return peak


def _max_len(runner: Runner, budget: int, limit: int) -> int:
    """Longest multiple of GRANULE whose step fits `budget` on every rank (the ranks agree)."""
    def fits(length: int) -> bool:
        peak = torch.tensor([float(runner.peak_bytes(length))])
        comm.all_reduce(peak, runner.mesh, "cp", op="max")
        return float(peak) <= budget

    low, high = 0, 512
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + GRANULE)
    while high - low > GRANULE:
        mid = (low + high) // 2 // GRANULE * GRANULE
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _timed(runner: Runner, length: int, steps: int) -> float:
    runner.step(length)  # warm
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step(length)
    seconds = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return steps * length / float(seconds)


def _sent_bytes(runner: Runner, length: int) -> int:
    runner.mesh.meter.take()
    runner.step(length)
    return runner.mesh.meter.take()["total"]


def _layer_bytes(mesh, method: str, length: int) -> int:
    """Wire bytes one rank sends for one attention layer's forward and backward at `length`."""
    from loomtrain.parallel.sequence.context import Ring, SeqContext
    from loomtrain.parallel.sequence.lasp import lasp_attention
    from loomtrain.parallel.sequence.ring import ring_attention

    layout = "contiguous" if method == "lasp" else "zigzag"
    ctx = SeqContext.of_ring(Ring(mesh, "cp"), length, layout)
    heads, dim = MODEL["n_heads"], MODEL["d_model"] // MODEL["n_heads"]
    q, k, v = (torch.rand(1, heads, length // mesh.size("cp"), dim, requires_grad=True)
               for _ in range(3))
    mesh.meter.take()
    out = lasp_attention(q, k, v, ctx) if method == "lasp" else ring_attention(q, k, v, ctx)
    out.sum().backward()
    return mesh.meter.take()["total"]


def _torch_context_parallel(world: int) -> dict:
    """torch's context_parallel around causal SDPA on (1, heads, 256, dim) tensors."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, MODEL["n_heads"], 256, 8) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return {"ran": True}
    except Exception as err:  # noqa: BLE001 - the outcome is what this records
        return {"ran": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}


def measure(rank: int, world: int, port: int, commands, results) -> None:
    """A `World` target: one mesh {"cp": world}; commands are (kind, kwargs)."""
    with joined_world(rank, world, port, timeout_s=600):
        mesh = build_mesh({"cp": world})
        runners: dict[str, Runner] = {}

        def runner(method: str) -> Runner:
            if method not in runners:
                runners[method] = Runner(mesh, method)
            return runners[method]

        handlers = {
            "max_len": lambda a: _max_len(runner(a["method"]), a["budget"], a["limit"]),
            "tokens_per_s": lambda a: _timed(runner(a["method"]), a["length"], a["steps"]),
            "bytes": lambda a: _sent_bytes(runner(a["method"]), a["length"]),
            "layer_bytes": lambda a: _layer_bytes(mesh, a["method"], a["length"]),
            "torch_cp": lambda a: _torch_context_parallel(world),
        }
        while (command := commands[rank].get()) is not None:
            kind, args = command
            results.put((rank, handlers[kind](args)))


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=48.0)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="smoke test: 12 MiB, rows up to 1024, one round")
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    args = parser.parse_args()
    if args.small:
        args.budget_mb, args.length, args.rounds, args.steps = 12.0, 128, 1, 1
    budget, limit = int(args.budget_mb * 2**20), 1024 if args.small else MODEL["seq_len"]
    lengths = [1024, 2048] if args.small else [1024, 2048, 4096, 8192, 16384]
    out: dict = {"max_seq_len": {m: {} for m in METHODS}, "config": {
        "model": MODEL, "budget_mb": args.budget_mb, "length": args.length, "rounds": args.rounds,
        "steps": args.steps, "small": args.small}}
    with closing_worlds({}) as worlds:
        for cp in (1, 2, 4):
            worlds[cp] = World(f"cp{cp}", cp, measure, (cp, free_port()), args.timeout_s)
        for cp, world in worlds.items():
            for method in METHODS:
                got = world.command(("max_len", {"method": method, "budget": budget, "limit": limit}))
                out["max_seq_len"][method][str(cp)] = got[0]
                print(f"max_seq_len {method} cp={cp}: {got[0]}", file=sys.stderr)
        rates: dict[str, list[float]] = {m: [] for m in (*METHODS, "cp1")}
        for r in range(args.rounds):
            order = list(METHODS) if r % 2 == 0 else list(METHODS)[::-1]
            for method in order:
                kw = {"method": method, "length": args.length, "steps": args.steps}
                rates[method].append(worlds[2].command(("tokens_per_s", kw))[0])
            kw = {"method": "ulysses", "length": args.length, "steps": args.steps}
            rates["cp1"].append(worlds[1].command(("tokens_per_s", kw))[0])
            print(f"round {r}: " + ", ".join(f"{m} {v[-1]:.0f}" for m, v in rates.items()),
                  file=sys.stderr)
        out["tokens_per_s"] = {m: round(statistics.median(v), 1) for m, v in rates.items()}
        out["bytes_per_step"] = {f"{m}_cp{cp}": worlds[cp].command(
            ("bytes", {"method": m, "length": args.length}))[0] for m in METHODS for cp in (2, 4)}
        for method in ("lasp", "ring"):
            out[f"{method}_bytes_per_layer"] = {str(t): worlds[2].command(
                ("layer_bytes", {"method": method, "length": t}))[0] for t in lengths}
        out["torch_context_parallel"] = worlds[2].command(("torch_cp", {}))[0]
    out["date"] = datetime.date.today().isoformat()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
