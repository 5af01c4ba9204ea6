"""The weave (issue 28): the axes of parallelism compose. Every layout here reproduces the
single-process losses of the same model and data (fp32, relative 1e-4, 12 steps); bf16
layouts stay within 2% of fp32. One spawned world per size, shared by all its layouts: the
pairs that join the pipeline at world 4, the 3-D and 4-D layouts at world 8 (oversubscribed
on two cores: tiny models, few steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import tiny_tree
from harness import run_world
from loomtrain.train import dryrun
from loomtrain.train.config import config_from_dict
from loomtrain.train.metrics import read_metrics
from test_zero import _train_many

GPT = {"n_layers": 6}  # 8 layers (embed, 6 blocks, head): 2 stages of 2 virtual ones each
LLAMA = {"name": "llama", "n_layers": 4, "d_model": 32, "n_heads": 4, "n_kv_heads": 2}
PACKED = {"packing": True}
BALANCED = {"packing": True, "balance": True}
BF16 = {"precision": "bf16"}


def _layout(parallel: dict, model: dict = GPT, data: dict | None = None,
            train: dict | None = None) -> tuple[dict, dict, dict, dict]:
    return parallel, model, data or {}, train or {}


LINEAR = {"n_layers": 2, "attention": "linear"}
PAIRS = [  # world 4: the pipeline with each axis it refused before issue 28 (tp2 x pp2 with
    # 1F1B and dp: the world-8 layouts), LASP with tp and pp, hierarchical ZeRO with cp
    _layout({"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "zb-h1",
             "recompute": "selective"}),
    _layout({"pp": 2, "tp": 2, "schedule": "optimal", "activation_budget_mb": 0.5}),
    _layout({"pp": 2, "cp": 2, "schedule": "interleaved", "virtual_stages": 2}),
    # every micro-batch's own document masks, restored before each of its forwards
    _layout({"pp": 2, "cp": 2, "cp_method": "ulysses", "schedule": "gpipe"}, data=PACKED),
    _layout({"pp": 2, "zero_stage": 3, "schedule": "interleaved", "virtual_stages": 2,
             "recompute": "full"}),
    _layout({"pp": 2, "zero_stage": 2, "schedule": "zb-h1"}),
    _layout({"pp": 2, "zero_stage": 1, "schedule": "zb-h1"}),
    _layout({"pp": 2, "cp": 2, "schedule": "1f1b"}, LLAMA),
    _layout({"cp": 2, "tp": 2, "sequence_parallel": True}, LINEAR),  # LASP
    # sharded inside a "node" of dp x cp peers, replicated across the two
    _layout({"cp": 2, "zero_stage": 3, "hierarchical": True, "ranks_per_node": 2}),
    _layout({"pp": 2, "cp": 2, "schedule": "1f1b"}, LINEAR),
    # automatic sequence parallelism: the tp model's trace rewritten (one head per tp rank:
    # the ring); under a pipeline the kernel its plan would choose (two heads: Ulysses)
    _layout({"cp": 2, "tp": 2, "cp_method": "auto", "sequence_parallel": True}),
    _layout({"pp": 2, "cp": 2, "cp_method": "auto", "schedule": "1f1b"}),
    _layout({"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "interleaved",
             "virtual_stages": 2}, LLAMA),
    # data.balance: each pool rank's tokens of every micro-batch, dealt alike on every stage,
    # received into buffers of that micro-batch's shape (dp2 x pp2, zero-bubble)
    _layout({"pp": 2, "schedule": "zb-h1"}, data=BALANCED),
]
PAIRS_BF16 = [  # world 4, within 2% of the fp32 run
    _layout({"pp": 2, "zero_stage": 3, "schedule": "1f1b"}, train=BF16),
    _layout({"pp": 2, "tp": 2, "schedule": "zb-h1"}, train=BF16),
]
WORLD8 = [  # the 3-D and 4-D layouts of the issue
    _layout({"pp": 2, "tp": 2, "schedule": "1f1b"}),  # dp2 x tp2 x pp2
    _layout({"pp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True, "schedule": "zb-h1"}),
    _layout({"pp": 2, "tp": 2, "cp": 2, "schedule": "interleaved", "virtual_stages": 2}),
    _layout({"pp": 2, "cp": 2, "zero_stage": 2, "schedule": "gpipe"}),  # dp2 x cp2 x pp2
]
STEPS = 12


def _trees(tmp_path, corpus, doc_corpus, world: int, layouts) -> list[dict]:
    trees = []
    for parallel, model, data, train in layouts:
        source = {"source": str(doc_corpus)} if data.get("packing") else {}
        trees.append(tiny_tree(tmp_path, corpus, model=model, data={**data, **source},
                               train={"steps": STEPS, **train},
                               parallel={"nproc": world, **(parallel if world > 1 else {})}))
    return trees


def _reference(layout) -> tuple:
    """The single-process run a layout is checked against: same model, data, fp32."""
    _, model, data, _ = layout
    return {}, model, data, {}


def _rel(got: list[dict], ref: list[dict], key: str) -> float:
    assert len(got) == len(ref) == STEPS
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got, ref))


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus, doc_corpus) -> dict:
    """{reference layout's repr: its loss curve}, all trained in one single-process world."""
    tmp = tmp_path_factory.mktemp("weave_ref")
    layouts = list({repr(_reference(x)): _reference(x) for x in PAIRS + PAIRS_BF16 + WORLD8}.values())
    run_world(_train_many, 1, _trees(tmp, corpus, doc_corpus, 1, layouts), str(tmp / "ref"),
              timeout_s=200)
    curves = {repr(x): read_metrics(tmp / "ref" / f"run{i}") for i, x in enumerate(layouts)}
    assert all(c[-1]["loss"] < c[0]["loss"] - 0.2 for c in curves.values())  # they learn
    return curves


def _metered(rank, world, trees, root) -> list | None:
    """`_train_many`, keeping what rank 0's meter counted in each run's second step, per
    (axis, op): (calls, wire bytes). The meter is read once at the start (the parameter
    broadcast), then once per step."""
    from loomtrain.train.launch import init_distributed
    from loomtrain.train.run import train_loop
    from loomtrain.train.trainer import StopFlag

    steps = []
    for i, tree in enumerate(trees):
        cfg, windows = config_from_dict(tree), []
        mesh = init_distributed(cfg)
        take, window = mesh.meter.take, mesh.meter.window

        def take_by_axis(take=take, window=window, windows=windows):  # once per record
            windows.append({key: (c.calls, c.wire_bytes) for key, c in window.items()})
            return take()
        mesh.meter.take = take_by_axis
        train_loop(cfg, Path(root) / f"run{i}", None, mesh, StopFlag())
        steps.append(windows[2])
    return steps if rank == 0 else None


def _predicted(cfg) -> dict:
    """The dry run's collectives of a step (log_every = 1, no evaluation), per (axis, op)."""
    out: dict = {}
    for c in dryrun.estimate(cfg).collectives:
        if c.every_steps == 1:
            calls, wire = out.get((c.axis, c.op), (0, 0))
            out[c.axis, c.op] = (calls + c.calls, wire + c.calls * c.wire_bytes)
    return out


def _check(tmp_path, corpus, doc_corpus, references, world, exact, bf16=(),
           train=_train_many) -> list:
    """Each layout's losses against its reference; returns rank 0's result of `train`."""
    out = run_world(train, world, _trees(tmp_path, corpus, doc_corpus, world, [*exact, *bf16]),
                    str(tmp_path / "w"), timeout_s=400)
    for i, layout in enumerate([*exact, *bf16]):
        got, ref = read_metrics(tmp_path / "w" / f"run{i}"), references[repr(_reference(layout))]
        if i < len(exact):
            # the same sums in other orders (stage by stage, ring merges, shard-wise norms)
            for key in ("loss", "grad_norm"):
                assert _rel(got, ref, key) < 1e-4, (layout, key, _rel(got, ref, key))
        else:
            assert _rel(got, ref, "loss") < 0.02, (layout, _rel(got, ref, "loss"))
    return out[0]


def test_every_pair_with_the_pipeline_at_world_4(tmp_path, corpus, doc_corpus, references):
    _check(tmp_path, corpus, doc_corpus, references, 4, PAIRS, PAIRS_BF16)


def test_the_3d_and_4d_layouts_at_world_8(tmp_path, corpus, doc_corpus, references):
    metered = _check(tmp_path, corpus, doc_corpus, references, 8, WORLD8, train=_metered)
    # `loom train --dry-run` predicts rank 0's collectives, call for call and byte for byte
    for tree, step in zip(_trees(tmp_path, corpus, doc_corpus, 8, WORLD8), metered):
        assert _predicted(config_from_dict(tree)) == step, tree["parallel"]
