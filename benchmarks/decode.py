"""Tensor-parallel decoding latency: exact, int8-compressed and overlapped all-reduces,
against torch's own DTensor tensor parallelism, in the same world.

    .venv/bin/python benchmarks/decode.py [--rounds 7] [--batch 4] [--new-tokens 64] [--small]

`measure_decode(rank, world, ...)` runs inside an already-initialized gloo world (every
rank calls it alike) and returns, on every rank, milliseconds per decoded token for:

- exact: loomtrain's `parallelize_tensor` GPT, decoded through its own forward and KV cache
  (Megatron's synchronous all-reduce after each attention and MLP);
- compressed: the same with the all-reduces sent as int8 with a scale per 64 values
  (`comm.quantized_all_reduce`, one all-gather);
- overlap: the batch as two nano-batches whose all-reduces run behind each other's compute
  (inference/nanobatch.py); compressed_overlap: both;
- torch: the same weights split by `torch.distributed.tensor.parallel.parallelize_module`
  (ColwiseParallel on qkv and fc, RowwiseParallel on the projections) over the mesh's tp
  DeviceMesh, decoded by the same GPT code and KV cache.

A round decodes, per variant, `new_tokens` greedy tokens: an untimed prefill of
`prompt_len` tokens gives the first, then `new_tokens - 1` timed one-token steps (the
slowest rank's time, from a barrier). Variants alternate in
each round, reversed every other round, after one untimed warm-up round; figures are medians
over rounds. Accuracy, once: the int8 path fed the exact path's greedy tokens (teacher
forcing) gives the largest |logit difference|; decoding freely gives the fraction of greedy
tokens equal to the exact path's.

The model is the GPT at random init with its matrices scaled by `weight_scale` (4: logits
spread over a few units, as a trained model's are, instead of GPT-2's near-uniform init
logits), unless `run_dir` names a `loom train` run whose newest checkpoint is decoded.

main() spawns a world of 2 (one torch thread per rank), adds `measure_all_reduce` (the two
all-reduces alone at 4 KiB, 64 KiB and 1 MiB) and prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import time

import torch
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from worlds import World, free_port, tp_rank

from loomtrain import comm
from loomtrain.inference import Decoder
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT
from loomtrain.parallel.tensor import parallelize_tensor

VARIANTS = {"exact": {}, "compressed": {"compress": "int8"}, "overlap": {"overlap": True},
            "compressed_overlap": {"compress": "int8", "overlap": True}, "torch": {}}


def _reference(d_model, n_layers, n_heads, vocab, seq_len, weight_scale, run_dir) -> GPT:
    if run_dir is not None:
        from loomtrain.inference.run_dir import (
            GenerateRequest,
            check_request,
            load_model,
        )
        model_cfg, path = check_request(GenerateRequest(str(run_dir)))
        return load_model(model_cfg, path)
    torch.manual_seed(0)  # the same weights on every rank
    model = GPT(vocab, seq_len, d_model, n_layers, n_heads).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(weight_scale)
    return model


def _torch_tp(reference: GPT, mesh) -> GPT:
    """`reference` split by torch's DTensor tensor parallelism. ColwiseParallel shards qkv's
    rows in contiguous blocks, so the rows are first permuted to [q_r; k_r; v_r] per rank:
    each rank's block then holds whole heads of q, k and v, as loomtrain's split does."""
    model = copy.deepcopy(reference)
    tp = mesh.size("tp")
    plan = {}
    for i, block in enumerate(model.blocks):
        d = block.attn.proj.in_features
        order = torch.arange(3 * d).view(3, tp, d // tp).transpose(0, 1).reshape(-1)
        with torch.no_grad():
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
        block.attn.n_heads //= tp
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    return parallelize_module(model, mesh.device_mesh["tp"], plan).eval()


def _decode(model, prompt, new_tokens, mesh, **decoding):
    """(ms per decode step, slowest rank; tp wire bytes per decode step on loomtrain's
    meter; the greedy tokens). The prefill's token is the first; the steps feed the rest."""
    decoder = Decoder(model, **decoding)
    token = decoder(prompt)[:, -1:].argmax(-1)
    tokens = [token]
    comm.barrier(mesh, "tp")
    wire = mesh.meter.total(axis="tp")
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = decoder(token)[:, -1:].argmax(-1)
        tokens.append(token)
    elapsed = torch.tensor([time.perf_counter() - start])
    wire = mesh.meter.total(axis="tp") - wire
    comm.all_reduce(elapsed, mesh, "tp", op="max")
    steps = new_tokens - 1
    return 1e3 * float(elapsed) / steps, wire // steps, torch.cat(tokens, dim=1)


def _forced_logits(model, prompt, tokens, **decoding) -> torch.Tensor:
    decoder = Decoder(model, **decoding)
    steps = [decoder(prompt)[:, -1:]] + [decoder(tokens[:, i:i + 1]) for i in range(tokens.shape[1] - 1)]
    return torch.cat(steps, dim=1)


def measure_decode(rank: int, world: int, *, d_model: int = 256, n_layers: int = 4,
                   n_heads: int = 8, vocab: int = 256, batch: int = 4, prompt_len: int = 8,
                   new_tokens: int = 64, rounds: int = 5, weight_scale: float = 4.0,
                   run_dir: str | None = None, mesh=None) -> dict:
    """Milliseconds per decoded token per variant (medians over rounds) and the int8 path's
    accuracy; see the module docstring. `mesh` must have a tp axis of size `world` (built
    here if None)."""
    mesh = mesh or build_mesh({"tp": world})
    reference = _reference(d_model, n_layers, n_heads, vocab, prompt_len + new_tokens,
                           weight_scale, run_dir)
    ours = parallelize_tensor(copy.deepcopy(reference), mesh)
    models = {name: ours for name in VARIANTS}
    models["torch"] = _torch_tp(reference, mesh)
    prompt = torch.randint(0, reference.tok_emb.num_embeddings, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    tokens, wire = {}, {}
    for r in range(rounds + 1):
        for name in (list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))):
            ms, wire[name], tokens[name] = _decode(models[name], prompt, new_tokens, mesh,
                                                   **VARIANTS[name])
            if r:  # round 0 warms up
                times[name].append(ms)
    exact_logits = _forced_logits(ours, prompt, tokens["exact"])
    int8_logits = _forced_logits(ours, prompt, tokens["exact"], compress="int8")
    diff = float((int8_logits - exact_logits).abs().max())
    match = lambda name: float((tokens[name] == tokens["exact"]).float().mean())  # noqa: E731
    out = {name: statistics.median(times[name]) for name in VARIANTS}
    out.update({
        "max_logit_diff_compressed": diff,
        "max_logit_rel_diff_compressed": diff / float(exact_logits.abs().max()),
        "greedy_match_compressed": match("compressed"),
        "greedy_match_overlap": match("overlap"),
        "greedy_match_compressed_overlap": match("compressed_overlap"),
        "greedy_match_torch": match("torch"),
        # per decode step, loomtrain's variants (torch's DTensor collectives bypass its meter)
        "wire_bytes_per_token": {name: wire[name] for name in VARIANTS if name != "torch"},
        "ms_spread": {name: [min(t), max(t)] for name, t in times.items()},
        "config": {"world": world, "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads,
                   "vocab": vocab, "batch": batch, "prompt_len": prompt_len,
                   "new_tokens": new_tokens, "rounds": rounds, "weight_scale": weight_scale,
                   "run_dir": run_dir, "threads": torch.get_num_threads()},
    })
    return out


def measure_all_reduce(mesh, sizes_bytes=(4 << 10, 64 << 10, 1 << 20), reps: int = 7) -> dict:
    """ms per call of the exact and the int8 all-reduce alone over tp, per fp32 payload
    size (slowest rank, medians over `reps`, the two alternating), to place decoding's
    messages on the curve of where int8 starts to pay on this machine."""
    out = {}
    for size in sizes_bytes:
        x = torch.randn(size // 4, generator=torch.Generator().manual_seed(0))
        calls = max(2, (256 << 10) // size)
        times: dict[str, list[float]] = {"exact": [], "int8": []}
        for r in range(reps + 1):
            for name in ("exact", "int8") if r % 2 else ("int8", "exact"):
                comm.barrier(mesh, "tp")
                start = time.perf_counter()
                for _ in range(calls):
                    y = x.clone()
                    if name == "exact":
                        comm.all_reduce(y, mesh, "tp")
                    else:
                        comm.quantized_all_reduce(y, mesh, "tp")
                elapsed = torch.tensor([(time.perf_counter() - start) / calls])
                comm.all_reduce(elapsed, mesh, "tp", op="max")
                if r:
                    times[name].append(1e3 * float(elapsed))
        out[str(size)] = {name: statistics.median(t) for name, t in times.items()}
    return out


def decode_and_all_reduce(rank: int, world: int, mesh=None, **kwargs) -> dict:
    """`measure_decode`, plus the two all-reduces timed alone (the command-line figures)."""
    figures = measure_decode(rank, world, mesh=mesh, **kwargs)
    figures["all_reduce_ms"] = measure_all_reduce(mesh)
    return figures


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--run-dir", help="decode this `loom train` run's checkpoint instead")
    parser.add_argument("--small", action="store_true", help="d_model 32, 2 layers: a smoke test")
    args = parser.parse_args(argv)
    kwargs = dict(rounds=args.rounds, batch=args.batch, new_tokens=args.new_tokens, run_dir=args.run_dir)
    if args.small:
        kwargs.update(d_model=32, n_layers=2, n_heads=4)
    t0 = time.perf_counter()
    world = World("decode", 2, tp_rank, (2, free_port(), decode_and_all_reduce), timeout_s=600)
    try:
        result = world.command(kwargs)[0]
        world.close()
    except BaseException:
        world.kill()
        raise
    out = {"benchmark": "decode", "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "cpus": os.cpu_count(),
           "wall_s": round(time.perf_counter() - t0, 1), "ms_per_token": {k: result.pop(k) for k in VARIANTS},
           **result}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
