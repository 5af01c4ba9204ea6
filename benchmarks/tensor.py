"""loomtrain's tensor parallelism against torch's DTensor tensor parallelism, in the same run.

    .venv/bin/python benchmarks/tensor.py [--rounds 8] [--steps 3] [--warmup 2]  # 1.5-3 min
    .venv/bin/python benchmarks/tensor.py --quick                                # smoke test

What is the same for every engine: tp = 2 (world 2, gloo on 127.0.0.1, one thread per rank),
a GPT (`loomtrain.models.GPT`, tied head, fp32) built from one seed, so the same initial
weights, the same batches at every step (a synthetic bigram source, see `batch_at`), the
loss `token_loss_sum / tokens` (the mean over tokens), backward, and AdamW (lr 1e-3, torch's
defaults otherwise: foreach) over every parameter of the rank.

Engines:
- `loomtrain`: `parallelize_tensor(model, mesh)`: attention's qkv and the MLP's fc column-
  parallel, their proj row-parallel; embedding, head and layer norms replicated.
- `loomtrain_vocab`: also `vocab_parallel=True`, loss `vocab_parallel_loss_sum`.
- `loomtrain_sp`: also `sequence_parallel=True` (the layer norms' and row biases' gradients
  are summed over tp inside backward).
- `torch_tp`: torch's `parallelize_module` on `mesh.device_mesh["tp"]`, ColwiseParallel for
  each block's attn.qkv and mlp.fc, RowwiseParallel for attn.proj and mlp.proj (DTensor
  parameters; the outputs of the row layers are replicated plain tensors). The GPT's fused
  qkv is [q; k; v] stacked by rows, so a plain column split would give rank 0 all of q and
  half of k: its rows are first permuted so that each rank's contiguous chunk holds its own
  heads' q, k and v (`head_major_qkv`), and each block's n_heads is divided by tp (the
  attention reads batch, time and head width from qkv's output). This is the split
  loomtrain makes, reached through torch's own API; it is the peer of `loomtrain` (both keep
  the embedding and head replicated).

Correctness, in every run: each rank computes the unsplit model's loss on batch 0 before it is
split; every engine's first loss must equal it (`first_step_loss_max_rel_diff`), and the
engines' last losses must agree after training on the same batches
(`last_step_loss_max_rel_diff`).

How (the scheme of benchmarks/ddp.py and zero.py): each engine trains in its own world of
spawned processes; the worlds take turns, the idle ones blocked on a queue, in an order
reversed every round with `loomtrain` and `torch_tp` always next to each other, so their pair
of rounds sees (nearly) the same machine load. `ratio` is the median over rounds of
loomtrain's tokens/s over torch's in the same pair. A round is timed on each rank from a
barrier to the end of its last step, the slower rank's time counting.

Communication: loomtrain's CommMeter counts the wire bytes its tp axis sends per step, set
against Megatron's count (`expected_tp_ops`): per layer and step, 2 all-reduces of the
activations (b x s x h fp32) forward and 2 backward, each ring all-reduce of S bytes sending
2(N-1)/N x S. Both engines' bytes written to sockets per step are measured too (`wchar`).

After the training rounds, in the plain loomtrain world: `decode_ms_per_token`
(benchmarks/decode.py's `measure_decode`: exact, int8, overlap, torch DTensor TP) and
`serving` (benchmarks/shift.py's `measure_serving`: tp, sp and shift on a mixed trace), both
on the training model's shape.

The last line on stdout is one JSON object (see `summarize`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from worlds import World, closing_worlds, free_port, serve_commands

from loomtrain import comm
from loomtrain.comm.collectives import choose_impl
from loomtrain.comm.meter import wire_bytes
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, token_loss_sum
from loomtrain.parallel.tensor import parallelize_tensor, vocab_parallel_loss_sum

WORLD = 2  # = tp
MODEL = {"vocab_size": 256, "seq_len": 128, "d_model": 384, "n_layers": 4, "n_heads": 8}
QUICK_MODEL = {"vocab_size": 64, "seq_len": 32, "d_model": 64, "n_layers": 2, "n_heads": 4}
# round order: loomtrain and torch_tp are neighbours in this order and in its reverse
ENGINES = ("loomtrain_vocab", "loomtrain_sp", "loomtrain", "torch_tp")
LR = 1e-3


# --- data --------------------------------------------------------------------------------------


def batch_at(step: int, seed: int, batch: int, seq_len: int, vocab: int):
    """(inputs, targets) of step `step`: chains of a fixed random bigram source in which each
    token has 4 possible successors, so the loss can fall from ln(vocab) towards ln(4) and
    the engines' training is compared on something they learn. Same on every rank."""
    table = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    choice = torch.randint(0, 4, (batch, seq_len), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = table[tokens[:, t], choice[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


# --- the engines (one rank) --------------------------------------------------------------------


def head_major_qkv(d_model: int, n_heads: int, parts: int) -> torch.Tensor:
    """Row order of a fused [q; k; v] weight in which part r's contiguous chunk is
    [q rows of r's heads; k rows; v rows], what a plain column split needs to be head-correct."""
    width = d_model // parts  # n_heads // parts heads of d_model // n_heads rows each
    assert n_heads % parts == 0 and d_model % parts == 0
    return torch.cat([torch.arange(j * d_model + r * width, j * d_model + (r + 1) * width)
                      for r in range(parts) for j in range(3)])


def torch_tensor_parallel(model: GPT, device_mesh) -> GPT:
    """torch's DTensor tensor parallelism on the GPT's attention and MLP pairs."""
    parts = device_mesh.size()
    plan = {}
    for i, block in enumerate(model.blocks):
        attn = block.attn
        order = head_major_qkv(attn.proj.in_features, attn.n_heads, parts)
        with torch.no_grad():
            attn.qkv.weight.copy_(attn.qkv.weight[order])
            attn.qkv.bias.copy_(attn.qkv.bias[order])
        attn.n_heads //= parts
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(),
                     f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(),
                     f"blocks.{i}.mlp.proj": RowwiseParallel()})
    return parallelize_module(model, device_mesh, plan)


def split(engine: str, model: GPT, mesh):
    """Split `model` for `engine`; returns (model, loss_sum(logits, targets))."""
    if engine == "torch_tp":
        return torch_tensor_parallel(model, mesh.device_mesh["tp"]), token_loss_sum
    if engine == "loomtrain":
        return parallelize_tensor(model, mesh), token_loss_sum
    model = parallelize_tensor(model, mesh, vocab_parallel=True,
                               sequence_parallel=engine == "loomtrain_sp")
    return model, lambda logits, y: vocab_parallel_loss_sum(logits, y, model.head)


def wchar_bytes() -> int:
    """Bytes this process (all its threads) handed to write()/writev(): gloo's TCP sends."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


class Trainer:
    """One rank of one engine's world, training from step 0 on."""

    def __init__(self, engine: str, model_cfg: dict, batch: int, seed: int):
        self.engine, self.model_cfg, self.batch, self.seed, self.step = (
            engine, model_cfg, batch, seed, 0)
        self.mesh = build_mesh({"tp": WORLD})
        torch.manual_seed(seed)
        model = GPT(**model_cfg)
        with torch.no_grad():  # the oracle: the unsplit model's loss on batch 0
            x, y = self._batch(0)
            self.unsplit_loss = float(token_loss_sum(model(x), y)) / y.numel()
        self.model, self.loss_sum = split(engine, model, self.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def _batch(self, step: int):
        m = self.model_cfg
        return batch_at(step, self.seed, self.batch, m["seq_len"], m["vocab_size"])

    def train(self, steps: int) -> float:
        """`steps` steps; the mean token loss of the last (the same on every tp rank)."""
        for _ in range(steps):
            x, y = self._batch(self.step)
            loss = self.loss_sum(self.model(x), y) / y.numel()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
        return float(loss.detach())

    def _slowest(self, seconds: float) -> float:
        elapsed = torch.tensor([seconds], dtype=torch.float64)
        comm.all_reduce(elapsed, self.mesh, "world", op="max")  # not on "tp": kept out of its count
        return float(elapsed)

    def timed_round(self, steps: int) -> dict:
        meter = self.mesh.meter
        comm.barrier(self.mesh)
        wire0, calls0 = meter.total("wire_bytes", axis="tp"), meter.total("calls", axis="tp")
        wchar0, t0, cpu0 = wchar_bytes(), time.perf_counter(), time.process_time()
        loss = self.train(steps)
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - t0
        socket_bytes = wchar_bytes() - wchar0
        elapsed = self._slowest(wall_s)
        tokens = steps * self.batch * self.model_cfg["seq_len"]
        return {"tokens_per_s": tokens / elapsed, "step_s": elapsed / steps,
                "cpu_s_per_step": cpu_s / steps, "last_step_loss": loss,
                "socket_bytes_per_step": socket_bytes / steps,
                "tp_wire_bytes_per_step": (meter.total("wire_bytes", axis="tp") - wire0) / steps,
                "tp_calls_per_step": (meter.total("calls", axis="tp") - calls0) / steps}

    def decode(self, quick: bool) -> dict:
        import decode  # the sibling modules (benchmarks/ is on sys.path when run as a script)
        m = self.model_cfg  # the training model's shape; 64 new tokens (8 with --quick)
        return decode.measure_decode(self.mesh.rank, WORLD, mesh=self.mesh, d_model=m["d_model"],
                                     n_layers=m["n_layers"], n_heads=m["n_heads"],
                                     vocab=m["vocab_size"], new_tokens=8 if quick else 64,
                                     rounds=1 if quick else 5)

    def serving(self, quick: bool) -> dict:
        import shift
        m = self.model_cfg
        return shift.measure_serving(self.mesh.rank, WORLD, mesh=self.mesh, d_model=m["d_model"],
                                     n_layers=m["n_layers"], n_heads=m["n_heads"],
                                     vocab=m["vocab_size"], quick=quick)


def _rank_main(rank: int, engine: str, port: int, model_cfg: dict, batch: int, seed: int,
               warmup: int, commands: list, results) -> None:
    """A spawned rank: set up, report the first step's losses after warm-up, then run one
    command at a time: ("round", steps), ("decode", quick), ("serving", quick), or None."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 cores, 2 ranks: the same for every engine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        trainer = Trainer(engine, model_cfg, batch, seed)
        first_loss = trainer.train(1)
        if warmup > 1:
            trainer.train(warmup - 1)
        results.put((rank, {"first_step_loss": first_loss, "unsplit_loss": trainer.unsplit_loss}))
        serve_commands(rank, commands, results,
                       {"round": trainer.timed_round, "decode": trainer.decode,
                        "serving": trainer.serving})
        comm.barrier(trainer.mesh)  # before destroy: avoids an intermittent abort (DESIGN.md)
    finally:
        dist.destroy_process_group()


# --- the communication count (pure) ------------------------------------------------------------


def expected_tp_ops(engine: str, model_cfg: dict, batch: int,
                    tp: int) -> list[tuple[str, int, int]]:
    """(op, payload bytes, calls per step) that Megatron's scheme issues on the tp axis.

    S = b x s x h x 4 bytes (an fp32 activation). Per layer: the attention's and the MLP's
    pair each all-reduce S once in forward (the row layer's output) and once in backward (the
    column layer's input gradient): 4 all-reduces. `loomtrain_vocab` adds the embedding's
    forward all-reduce of S, the head's backward one (its input gradient, a column layer),
    and the loss's three all-reduces of one fp32 number per token (max, sum of exponentials,
    target logit). `loomtrain_sp` replaces every all-reduce of S by an all-gather and a
    reduce-scatter of payload S, the head too, and adds the all-gather of the sequence split's
    gradient after the embedding and one all-reduce per tensor of the layer norms' and row
    biases' gradients inside backward (2 x 2h per block's layer norms, h per row bias, 2h for
    the final norm: 6 per block and 2).
    """
    b, s, h, layers = batch, model_cfg["seq_len"], model_cfg["d_model"], model_cfg["n_layers"]
    act, per_token = 4 * b * s * h, 4 * b * s
    if engine in ("loomtrain", "torch_tp"):
        return [("all_reduce", act, 4 * layers)]
    loss = [("all_reduce", per_token, 3)]
    if engine == "loomtrain_vocab":
        return [("all_reduce", act, 4 * layers + 2)] + loss
    return [("all_gather", act, 4 * layers + 2), ("reduce_scatter", act, 4 * layers + 1),
            ("all_reduce", act, 1), ("all_reduce", 4 * h, 6 * layers + 2)] + loss


def expected_tp_wire_bytes(engine: str, model_cfg: dict, batch: int, tp: int) -> dict:
    """Calls and wire bytes per step of `expected_tp_ops`, each op counted with the algorithm
    loomtrain's comm layer runs for its size (gloo's native reduce-scatter below the ring's
    threshold is a full all-reduce on the wire: 2(N-1)/N, not (N-1)/N)."""
    algorithm = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather"}
    total, calls = 0, 0
    for op, payload, n in expected_tp_ops(engine, model_cfg, batch, tp):
        alg = algorithm.get(op) or ("ring_reduce_scatter" if choose_impl(op, payload, tp) == "ring"
                                    else "ring_all_reduce")
        total += n * wire_bytes(alg, payload, tp)
        calls += n
    return {"calls": calls, "wire_bytes": total}


# --- the summary -------------------------------------------------------------------------------


def engine_figures(rounds: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in rounds)
           for k in ("tokens_per_s", "step_s", "cpu_s_per_step", "socket_bytes_per_step")}
    out["last_step_loss"] = rounds[-1]["last_step_loss"]
    out["per_round_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in rounds]
    return out


def pair_ratio(a: list[dict], b: list[dict]) -> float:
    return statistics.median(x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a, b))


def summarize(rounds: dict[str, list[dict]], first: dict[str, dict], args, model_cfg: dict) -> dict:
    fig = {e: engine_figures(rounds[e]) for e in ENGINES}
    lt, tt = rounds["loomtrain"], rounds["torch_tp"]
    out = {"benchmark": "tensor", "tp": WORLD, "date": datetime.date.today().isoformat(),
           "rounds": args.rounds, "steps": args.steps, "warmup_steps": args.warmup,
           "loomtrain_tokens_per_s": fig["loomtrain"]["tokens_per_s"],
           "torch_tp_tokens_per_s": fig["torch_tp"]["tokens_per_s"],
           "ratio": pair_ratio(lt, tt),
           "ratio_of_medians": fig["loomtrain"]["tokens_per_s"] / fig["torch_tp"]["tokens_per_s"],
           "cpu_ratio": statistics.median(b["cpu_s_per_step"] / a["cpu_s_per_step"]
                                          for a, b in zip(lt, tt)),  # > 1: loomtrain costs less
           "loomtrain_vocab_tokens_per_s": fig["loomtrain_vocab"]["tokens_per_s"],
           "loomtrain_sp_tokens_per_s": fig["loomtrain_sp"]["tokens_per_s"],
           "engines": fig}
    pairs = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(lt, tt)]
    if len(pairs) > 1:
        q1, _, q3 = statistics.quantiles(pairs, n=4, method="inclusive")
        out["pair_ratio_q1"], out["pair_ratio_q3"] = q1, q3
    unsplit = first["loomtrain"]["unsplit_loss"]
    out["unsplit_first_step_loss"] = unsplit
    out["first_step_losses"] = {e: first[e]["first_step_loss"] for e in ENGINES}
    out["first_step_loss_max_rel_diff"] = max(abs(first[e]["first_step_loss"] - unsplit) / unsplit
                                              for e in ENGINES)
    last = [fig[e]["last_step_loss"] for e in ENGINES]
    out["last_step_loss_max_rel_diff"] = (max(last) - min(last)) / min(last)
    # fp32: the splits reorder sums (partial products all-reduced), nothing else
    out["losses_agree"] = max(out["first_step_loss_max_rel_diff"],
                              out["last_step_loss_max_rel_diff"]) <= 1e-5
    out["tp_bytes"] = {"formula": "per layer per step 4 ring all-reduces (2 forward, 2 backward) "
                                  "of S = b*s*h*4 bytes, each 2(N-1)/N*S on the wire; see "
                                  "expected_tp_ops for vocab_parallel and sequence_parallel"}
    for e in ("loomtrain", "loomtrain_vocab", "loomtrain_sp"):
        expected = expected_tp_wire_bytes(e, model_cfg, args.batch, WORLD)
        measured = {"calls": statistics.median(r["tp_calls_per_step"] for r in rounds[e]),
                    "wire_bytes": statistics.median(r["tp_wire_bytes_per_step"] for r in rounds[e])}
        out["tp_bytes"][e] = {
            "expected": expected, "measured": measured,
            "measured_over_expected": measured["wire_bytes"] / expected["wire_bytes"]}
    out["config"] = {"model": model_cfg, "batch": args.batch,
                     "tokens_per_step": args.batch * model_cfg["seq_len"], "seed": args.seed,
                     "quick": args.quick, "optimizer": f"AdamW lr {LR} (torch defaults: foreach)",
                     "dtype": "fp32", "backend": "gloo on 127.0.0.1", "threads_per_rank": 1,
                     "torch": torch.__version__}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per engine (8)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (3)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps at the start of each world (the first: the loss check)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny GPT, 1 round of 1 step (the smoke test)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="fail if a world gives no result for this long")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 8)
    args.steps = args.steps or (1 if args.quick else 3)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--rounds, --steps and --warmup must be at least 1 (the first step is the "
                     "loss check, and it is never timed)")
    model_cfg = QUICK_MODEL if args.quick else MODEL
    start = time.perf_counter()
    with closing_worlds({}) as worlds:
        for e in ENGINES:  # set-up and warm-up side by side: nothing is timed there
            worlds[e] = World(e, WORLD, _rank_main, (e, free_port(), model_cfg, args.batch,
                                                     args.seed, args.warmup), args.timeout_s)
        first = {e: w.collect()[0] for e, w in worlds.items()}
        rounds: dict[str, list[dict]] = {e: [] for e in ENGINES}
        for i in range(args.rounds):
            for e in ENGINES if i % 2 == 0 else ENGINES[::-1]:
                r = worlds[e].command(("round", args.steps))[0]
                rounds[e].append(r)
                print(f"round {i + 1}/{args.rounds} {e:>15}: {r['tokens_per_s']:8.1f} tok/s, "
                      f"step {r['step_s'] * 1e3:6.1f} ms ({time.perf_counter() - start:.0f} s)",
                      file=sys.stderr, flush=True)
        out = summarize(rounds, first, args, model_cfg)
        # --- decode section (optional): benchmarks/decode.py, when another change adds it ---
        out["decode_ms_per_token"] = worlds["loomtrain"].command(("decode", args.quick))[0]
        out["serving"] = worlds["loomtrain"].command(("serving", args.quick))[0]
    out["wall_s"] = time.perf_counter() - start
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
