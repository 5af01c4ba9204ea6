"""Tensor parallelism in the trainer (`parallel.tp`, `parallel.sequence_parallel`): the
single-process oracle alone and composed with data parallel and ZeRO, activation memory and
wire bytes against the formulas (checkpoints across layouts: tests/test_checkpoint_layouts.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

from conftest import tiny_tree
from harness import run_world
from loomtrain.cli import main
from loomtrain.comm import wire_bytes
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, token_loss_sum
from loomtrain.parallel.tensor import parallelize_tensor, vocab_parallel_loss_sum
from loomtrain.train import checkpoint, trainer
from loomtrain.train.config import config_from_dict
from loomtrain.train.metrics import read_metrics
from test_zero import _train_many

TP_ORACLE = {  # world -> configurations checked against the single-process run (tp alone
    # and with the pipeline: tests/test_weave.py)
    4: [{"tp": 2}, {"tp": 2, "sequence_parallel": True, "zero_stage": 1},
        {"tp": 2, "zero_stage": 2}, {"tp": 2, "sequence_parallel": True, "zero_stage": 3}],
}
# a vocabulary tp does not divide: 257 at tp 2 is padded to 258 (rank 1's last row), run at
# world 4 as tp 2 x dp 2 with ZeRO-3 and sequence parallelism, checkpointed at its last step
PADDED = ({"vocab_size": 257}, {"tp": 2, "sequence_parallel": True, "zero_stage": 3})


def _mlp_configs(configs):
    """The MLP runs the plain splits, alone and under the ZeRO-2 engine: sequence parallelism
    is the GPT's, and stages 1 and 3 add nothing its plan does not meet at stage 2 (the GPT
    covers them), which keeps the suite's time in bounds."""
    plain = [{k: v for k, v in c.items() if k != "sequence_parallel"} for c in configs
             if c.get("zero_stage", 2) == 2]
    return [c for i, c in enumerate(plain) if c not in plain[:i]]


def test_oracle_tensor_parallel_alone_and_with_dp_and_zero(tmp_path, corpus):
    """The GPT and the MLP model, and the GPT with a padded vocabulary (`PADDED`); each world
    runs all its configurations (one spawn). The padded run's checkpoint holds the unpadded
    tensors and exports as the unsplit model's."""
    def curves(world, cases):
        trees = [tiny_tree(tmp_path, corpus, model=m, parallel={"nproc": world, **c},
                           checkpoint={"every": 20 if "vocab_size" in m else 0})
                 for m, c in cases]
        run_world(_train_many, world, trees, str(tmp_path / f"w{world}"), timeout_s=400)
        return [(m, c, read_metrics(tmp_path / f"w{world}" / f"run{i}"))
                for i, (m, c) in enumerate(cases)]
    vocab, padded = PADDED
    models = [{"name": "gpt"}, {"name": "mlp"}, {"name": "gpt", **vocab}]
    references = {str(m): records for m, _, records in curves(1, [(m, {}) for m in models])}
    for records in references.values():
        assert len(records) == 20 and records[-1]["loss"] < records[0]["loss"] - 0.3
    for world, configs in TP_ORACLE.items():
        cases = [(models[0], c) for c in configs] + [(models[1], c) for c in _mlp_configs(configs)]
        for model, cfg, records in curves(world, cases + [(models[2], padded)]):
            reference = references[str(model)]
            # fp32 sums in another order (partial products all-reduced, the vocabulary-split
            # softmax, shard-wise norms) differ in the last bits: ~1e-7 after 20 AdamW steps
            for key in ("loss", "grad_norm"):
                rel = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(records, reference))
                assert rel < 1e-4, (model, world, cfg, key, rel)
    saved = tmp_path / f"w{world}" / f"run{len(cases)}"
    trainer.write_config(saved, config_from_dict(tiny_tree(  # as `loom train` does
        tmp_path, corpus, model=models[2], parallel={"nproc": world, **padded})))
    _check_unpadded(saved, tmp_path / "w1" / "run2", vocab)


def _check_unpadded(saved, reference, vocab):
    """The padded run's checkpoint and export: the unsplit model's names and shapes, and
    the single-process run's values. After 20 AdamW steps (lr 3e-3) from the same start the
    fp32 rounding of the split sums moves a weight by up to 2e-6 (measured: AdamW's update of
    a near-zero gradient is its sign times ~lr); misplaced or padded rows would differ by the
    weights' own size (~1e-2)."""
    full = checkpoint.load_model_state(checkpoint.list_checkpoints(saved)[-1])
    want = checkpoint.load_model_state(checkpoint.list_checkpoints(reference)[-1])
    assert {k: tuple(v.shape) for k, v in full.items()} == {
        k: tuple(v.shape) for k, v in GPT(vocab["vocab_size"], 32, 32, 2, 2).state_dict().items()}
    for name, value in full.items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
    out = saved / "model.safetensors"
    assert main(["export", str(saved), "--out", str(out)]) == 0
    with safe_open(str(out), "pt") as f:
        assert torch.equal(f.get_tensor("tok_emb.weight"), full["tok_emb.weight"])


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn()` runs."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _activation_case(rank, world):
    mesh = build_mesh({"tp": world})
    torch.manual_seed(0)
    reference = GPT(64, 64, 64, 2, 4)
    x = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    out = {}
    for sp in (False, True):
        model = parallelize_tensor(copy.deepcopy(reference), mesh, vocab_parallel=True,
                                   sequence_parallel=sp)
        out[sp] = _saved_bytes(lambda: vocab_parallel_loss_sum(model(x), x, model.head))[0]
    out["single"] = _saved_bytes(lambda: token_loss_sum(reference(x), x))[0]
    return out


def test_sequence_parallel_saves_activation_memory():
    for r in run_world(_activation_case, 2, timeout_s=120):
        assert r[True] < r[False] < r["single"], r


def _wire_case(rank, world, b, t, d, sp):
    """Wire bytes on tp of one forward and one backward, for 1 and for 2 layers."""
    mesh = build_mesh({"tp": world})
    out = []
    for layers in (1, 2):
        torch.manual_seed(0)
        model = parallelize_tensor(GPT(64, t, d, layers, 4), mesh, vocab_parallel=sp,
                                   sequence_parallel=sp)
        x = torch.randint(0, 64, (b, t))
        mesh.meter.take()
        loss = (vocab_parallel_loss_sum(model(x), x, model.head) if sp
                else token_loss_sum(model(x), x))
        forward = mesh.meter.take()
        loss.backward()
        out.append((forward["total"], mesh.meter.take()["total"]))
    return out


@pytest.mark.parametrize("sp", [False, True])
def test_wire_bytes_per_layer_match_megatron(sp):
    """Megatron (Shoeybi et al., section 3): per layer, 2 all-reduces forward (after attention
    and after the MLP) and 2 backward (before qkv and before fc) of the b x s x h activation;
    a ring all-reduce of S bytes sends 2(N-1)/N x S. Sequence parallel (Korthikanti et al.,
    section 4.2.2): each becomes an all-gather and a reduce-scatter, (N-1)/N x S each, and
    backward also sums the gradients of the 2 layer norms and 2 row biases (6 x h floats).
    The activation is 256 KiB, where comm/ runs reduce-scatter as a ring (a smaller one runs
    as gloo's all-reduce and sends twice as much, docs/comm.md). Layer 2 minus layer 1 leaves
    out the embedding, head and loss."""
    world, b, t, d = 2, 4, 64, 256
    (fwd1, bwd1), (fwd2, bwd2) = run_world(_wire_case, world, b, t, d, sp, timeout_s=120)[0]
    activation = wire_bytes("ring_all_reduce", b * t * d * 4, world)
    norms_and_biases = wire_bytes("ring_all_reduce", 6 * d * 4, world) if sp else 0
    assert fwd2 - fwd1 == 2 * activation
    assert bwd2 - bwd1 == 2 * activation + norms_and_biases
