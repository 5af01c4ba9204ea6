"""The weave (issue 28): the axes of parallelism compose. Every layout here reproduces the
single-process losses of the same model and data (fp32, relative 1e-4, 12 steps); bf16
layouts stay within 2% of fp32. One spawned world per size, shared by all its layouts: the
pairs that join the pipeline at world 4, the 3-D and 4-D layouts at world 8 (oversubscribed
on two cores: tiny models, few steps). Methods with maths of their own are checked against
themselves in the same worlds: the asynchronous pipeline in ZeRO's engine and bf16 against
the plain stream (world 4), DASO over split replicas against whole ones (world 8 against
world 4)."""

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
    ZERO3_STEP := _layout({"pp": 2, "zero_stage": 3, "schedule": "interleaved",
                           "virtual_stages": 2, "recompute": "full", "zero_reshard": "step"}),
    # every unit freed after its forward and gathered again for its backward, per micro-batch
    ZERO3_MICRO := _layout({**ZERO3_STEP[0], "zero_reshard": "micro_batch"}),
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
# the asynchronous pipeline (its own maths: weight stashing, an update per micro-batch) in
# ZeRO's engine and in bf16, each against the same stream without ZeRO in fp32, in the
# world-4 spawn; 4 steps of 2 micro-batches: from step 3 on (the one metered) every update
# of rank 0 applies a tied contribution (lag pp = 2), the stream's steady state that the dry
# run counts
ASYNC = [{}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
         {"zero_stage": 3, "precision": "bf16"}, {"precision": "bf16"}]
ASYNC_STEPS, METERED_STEP = 4, 3
# DASO, one step stale, adaptive, with two tp2 replicas per node (dp4 x tp2, 4 ranks per
# node) at world 8, against whole replicas two per node (dp4, 2 ranks per node) at world 4
DASO = {"algorithm": "hierarchical", "inner_steps": 2, "adaptive_period": True}
DASO_SPLIT = {"tp": 2, "ranks_per_node": 4}


def _trees(tmp_path, corpus, doc_corpus, world: int, layouts) -> list[dict]:
    trees = []
    for parallel, model, data, train in layouts:
        source = {"source": str(doc_corpus)} if data.get("packing") else {}
        trees.append(tiny_tree(tmp_path, corpus, model=model, data={**data, **source},
                               train={"steps": STEPS, **train},
                               parallel={"nproc": world, **(parallel if world > 1 else {})}))
    return trees


def _async_trees(tmp_path, corpus) -> list[dict]:
    out = []
    for keys in ASYNC:
        zero = {k: v for k, v in keys.items() if k != "precision"}
        out.append(tiny_tree(tmp_path, corpus, run={"device": "cpu"},
                             train={"steps": ASYNC_STEPS, "precision": keys.get("precision", "fp32")},
                             parallel={"nproc": 4, "pp": 2, "schedule": "async", **zero}))
    return out


def _daso_tree(tmp_path, corpus, world: int, parallel: dict) -> dict:
    return tiny_tree(tmp_path, corpus, lowcomm=DASO, train={"steps": STEPS},
                     parallel={"nproc": world, "ranks_per_node": 2, **parallel})


def _reference(layout) -> tuple:
    """The single-process run a layout is checked against: same model, data, fp32."""
    _, model, data, _ = layout
    return {}, model, data, {}


def _rel(got: list[dict], ref: list[dict], key: str, steps: int = STEPS) -> float:
    assert len(got) == len(ref) == steps
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


def _metered(rank, world, trees, root, every_rank: bool = False, resumes=(), step: int = 2,
             after=None) -> list | None:
    """`_train_many`, keeping what rank 0's meter counted in each run's step `step`, per
    (axis, op): (calls, wire bytes). The meter is read once at the start (the parameter
    broadcast), then once per step. `every_rank`: every rank returns its own, with the
    payload bytes as well; `resumes[i]`: the checkpoint run i resumes from (None: none);
    `after()`: called after each run."""
    from loomtrain.train.launch import init_distributed
    from loomtrain.train.run import train_loop
    from loomtrain.train.trainer import StopFlag

    steps = []
    for i, tree in enumerate(trees):
        cfg, windows = config_from_dict(tree), []
        mesh = init_distributed(cfg)
        take, window = mesh.meter.take, mesh.meter.window

        def take_by_axis(take=take, window=window, windows=windows):  # once per record
            windows.append({key: (c.calls, c.wire_bytes, c.payload_bytes)[:3 if every_rank else 2]
                            for key, c in window.items()})
            return take()
        mesh.meter.take = take_by_axis
        resume = resumes[i] if i < len(resumes) else None
        train_loop(cfg, Path(root) / f"run{i}", resume and Path(resume), mesh, StopFlag())
        steps.append(windows[step])
        if after is not None:
            after()
    return steps if rank == 0 or every_rank else None


def _predicted(cfg) -> dict:
    """The dry run's collectives of a step (log_every = 1, no evaluation), per (axis, op)."""
    out: dict = {}
    for c in dryrun.estimate(cfg).collectives:
        if c.every_steps == 1:
            calls, wire = out.get((c.axis, c.op), (0, 0))
            out[c.axis, c.op] = (calls + c.calls, wire + c.calls * c.wire_bytes)
    return out


def _check(run_dir: Path, references, exact, bf16=()) -> None:
    """Each layout's losses (runs 0, 1, ... of `run_dir`) against its reference."""
    for i, layout in enumerate([*exact, *bf16]):
        got, ref = read_metrics(run_dir / f"run{i}"), references[repr(_reference(layout))]
        if i < len(exact):
            # the same sums in other orders (stage by stage, ring merges, shard-wise norms)
            for key in ("loss", "grad_norm"):
                assert _rel(got, ref, key) < 1e-4, (layout, key, _rel(got, ref, key))
        else:
            assert _rel(got, ref, "loss") < 0.02, (layout, _rel(got, ref, "loss"))


def _probed(rank, world, trees, root, step: int) -> tuple | None:
    """`_metered` (rank 0's meter of each run's step `step`), also measuring on rank 0 in
    each run the ZeRO engine's peak bytes of gathered units inside a pipelined step (the
    storage of every unit's gather buffer, after each gather starts) and its held unreduced
    gradients at the end of the step: (meters, probes)."""
    from loomtrain.parallel.zero.engine import ShardedDataParallel as Engine

    start, sync, probe, probes = Engine._start_gather, Engine.sync_gradients, {}, []

    def start_gather(self, u):
        start(self, u)
        if self._holding():
            live = sum(x._gathered.untyped_storage().nbytes() for x in self.all_units
                       if x._gathered is not None)
            probe["gathered"] = max(probe.get("gathered", 0), live)

    def sync_gradients(self):
        held = sum(4 * x.held.numel() for x in self.all_units if x.held is not None)
        probe["held"] = max(probe.get("held", 0), held)
        sync(self)
    Engine._start_gather, Engine.sync_gradients = start_gather, sync_gradients
    def keep():
        probes.append(dict(probe))
        probe.clear()
    meters = _metered(rank, world, trees, root, step=step, after=keep)
    return (meters, probes) if rank == 0 else None


@pytest.fixture(scope="module")
def world4(tmp_path_factory, corpus, doc_corpus) -> tuple[Path, list, list, list]:
    """The one world-4 spawn: PAIRS, PAIRS_BF16, the ASYNC runs, then DASO's whole replicas;
    (its folder, the trees, rank 0's meter of each run's step METERED_STEP, its ZeRO probes)."""
    tmp = tmp_path_factory.mktemp("weave4")
    trees = (_trees(tmp, corpus, doc_corpus, 4, [*PAIRS, *PAIRS_BF16])
             + _async_trees(tmp, corpus) + [_daso_tree(tmp, corpus, 4, {})])
    metered, probes = run_world(_probed, 4, trees, str(tmp / "w"), METERED_STEP,
                                timeout_s=400)[0]
    return tmp / "w", trees, metered, probes


def test_every_pair_with_the_pipeline_at_world_4(world4, references):
    run_dir, trees, _, probes = world4
    _check(run_dir, references, PAIRS, PAIRS_BF16)
    for tree, probe in zip(trees[:len(PAIRS) + len(PAIRS_BF16)], probes):
        p = tree["parallel"]
        if p.get("zero_stage", 0) < 2 or p.get("pp", 1) == 1:
            continue
        est = dryrun.estimate(config_from_dict(tree))
        # every unit's fp32 gradient summed over the step's micro-batches (4P), either reshard
        assert probe["held"] == 4 * (sum(n for _, n in est.zero.units) + est.zero.root), p
        # "step": the root and every unit; "micro_batch": the root and a prefetch window
        assert probe.get("gathered", 0) == est.memory.gathered_bytes, p
    step, micro = (read_metrics(run_dir / f"run{PAIRS.index(x)}") for x in (ZERO3_STEP, ZERO3_MICRO))
    assert [r["loss"] for r in micro] == [r["loss"] for r in step]  # the same sums, bitwise



def test_async_pipeline_with_zero_and_bf16_at_world_4(world4):
    run_dir, trees, metered, _ = world4
    first = len(PAIRS) + len(PAIRS_BF16)
    curves = [read_metrics(run_dir / f"run{first + i}") for i in range(len(ASYNC))]
    ref = curves[0]  # the stream without ZeRO, fp32
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.3  # it learns
    for keys, got in zip(ASYNC[1:], curves[1:]):
        if "precision" in keys:
            assert _rel(got, ref, "loss", ASYNC_STEPS) < 0.02, (keys, got, ref)
        else:  # the same sums in other orders (shard-wise norms, reduce-scatters)
            for key in ("loss", "grad_norm"):
                assert _rel(got, ref, key, ASYNC_STEPS) < 1e-4, (keys, key, got, ref)
    # the dry run's steady-state step: rank 0's collectives, call for call, byte for byte
    for i, tree in enumerate(trees[first:first + len(ASYNC)]):
        assert _predicted(config_from_dict(tree)) == metered[first + i], ASYNC[i]


def test_the_3d_and_4d_layouts_at_world_8(tmp_path, corpus, doc_corpus, references, world4):
    trees = _trees(tmp_path, corpus, doc_corpus, 8, WORLD8)
    daso = _daso_tree(tmp_path, corpus, 8, DASO_SPLIT)
    metered = run_world(_metered, 8, [*trees, daso], str(tmp_path / "w"), timeout_s=400)[0]
    _check(tmp_path / "w", references, WORLD8)
    # `loom train --dry-run` predicts rank 0's collectives, call for call and byte for byte
    for tree, step in zip(trees, metered):
        assert _predicted(config_from_dict(tree)) == step, tree["parallel"]
    # DASO over split replicas, two on each node: the whole replicas' losses and periods
    got = read_metrics(tmp_path / "w" / f"run{len(WORLD8)}")
    whole = read_metrics(world4[0] / f"run{len(world4[1]) - 1}")
    assert _rel(got, whole, "loss") < 1e-4, _rel(got, whole, "loss")
    assert ([r["global_period_steps"] for r in got]
            == [r["global_period_steps"] for r in whole])
