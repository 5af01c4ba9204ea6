"""The model built on the meta device and materialized per rank after the split
(train/materialize.py, train/apply.py `build_run`): every model family, unsplit and under
tp=2 and pp=2, holds bitwise the tensors of the eager build then split, and the random state
ends where the eager build leaves it; a rank holds less than the whole model while building;
what cannot be replayed is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import tiny_tree
from harness import run_world
from loomtrain.models import GPT, MLP, MLPClassifier
from loomtrain.train.config import config_from_dict
from loomtrain.train.init_record import NotRecordable, record_init
from loomtrain.train.materialize import materialize, setup_peak, setup_peak_bytes

FAMILIES = {  # every model models/ builds
    "gpt": lambda: GPT(64, 16, 32, 2, 4),
    "gpt-linear-decay": lambda: GPT(64, 16, 32, 2, 4, attention="linear", linear_decay=True),
    "mlp": lambda: MLP(64, 32, 2),
    "classifier": lambda: MLPClassifier(64, 10, 32, 2),
}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)  # under a dp engine
    return {n: t.detach().clone() for n, t in (*module.named_parameters(remove_duplicate=False),
                                               *module.named_buffers(remove_duplicate=False))
            if t is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unsplit_model_is_the_eager_one_bitwise(family):
    torch.manual_seed(7)
    eager = FAMILIES[family]()
    after = torch.get_rng_state()
    torch.manual_seed(7)
    model, record = record_init(FAMILIES[family])
    assert all(t.is_meta for t in model.parameters())
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(7).get_state())  # nothing drawn
    estimate = setup_peak_bytes(model, record)
    peak = materialize(model, record, "cpu")
    assert torch.equal(torch.get_rng_state(), after)
    want, got = _tensors(eager), _tensors(model)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)
    # unsplit, a rank holds the whole model (the tied head is its embedding, counted once)
    assert peak == estimate == record.model_bytes
    if isinstance(model, GPT):
        assert model.head.weight is model.tok_emb.weight


class _Norms(nn.Module):
    """What a Llama-style model does: RMSNorm weights from torch.ones, a random factory."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.proj = nn.Parameter(torch.randn(8, 8))
        self.out = nn.Linear(8, 8)
        with torch.no_grad():
            self.out.weight.mul_(0.5).add_(1.0)  # in-place changes after the init replay too


def test_factories_and_in_place_changes_replay_bitwise():
    torch.manual_seed(3)
    eager = _Norms()
    torch.manual_seed(3)
    model, record = record_init(_Norms)
    materialize(model, record, "cpu")
    want, got = _tensors(eager), _tensors(model)
    assert all(torch.equal(want[n], got[n]) for n in want)


class _Truncated(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        nn.init.trunc_normal_(self.w)  # a rejection sampler that draws nothing on meta


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.02)  # a value computed, not written


class _Computed(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4.0).exp())


class _Partial(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4, padding_idx=0)  # zeroes one row after normal_


@pytest.mark.parametrize("module, message", [
    (_Truncated, "asks whether a tensor is on the meta device"),
    (_Scaled, "w is not initialized in place"),
    (_Computed, "give _Computed an init_buffers"),
    (_Partial, "changes it in part"),
])
def test_what_cannot_be_replayed_is_refused(module, message):
    with pytest.raises(NotRecordable, match=message):
        record_init(module)


# --- 2 ranks: the split model, materialized, against the eager build then split ---------------

LAYOUTS = [  # (model section, parallel section); classification splits neither tp nor pp
    ({"name": "gpt"}, {"tp": 2}),
    ({"name": "gpt"}, {"tp": 2, "sequence_parallel": True}),
    ({"name": "mlp"}, {"tp": 2}),
    ({"name": "gpt"}, {"pp": 2}),
    ({"name": "gpt", "n_layers": 4}, {"pp": 2, "schedule": "interleaved", "virtual_stages": 2}),
    ({"name": "gpt", "attention": "linear", "linear_decay": True}, {"pp": 2}),
    ({"name": "mlp"}, {"pp": 2}),
    ({"name": "gpt"}, {"pp": 2, "zero_stage": 1}),
    ({"name": "gpt"}, {"pp": 2, "schedule": "optimal"}),  # profiles its stages: real ones
    ({"name": "gpt"}, {"pp": 2, "schedule": "async"}),  # its optimizer holds the parameters
    ({"name": "gpt"}, {"pp": 2, "pipeline_balance": "time"}),  # times the whole model first
    ({"name": "gpt"}, {"dp": 2, "zero_stage": 3}),
    ({"name": "mlp"}, {"dp": 2}),  # with data.source="digits": the classifier (dp engines only)
]


def _compare(rank, world, trees):
    from loomtrain.optim import build_optimizer
    from loomtrain.train.apply import build, build_run
    from loomtrain.train.launch import init_distributed
    from loomtrain.train.task import build_task_model

    out = []
    for tree in trees:
        cfg = config_from_dict(tree)
        mesh = init_distributed(cfg)
        optimizer = lambda m: build_optimizer(m, cfg.train)  # noqa: E731
        torch.manual_seed(cfg.run.seed)
        eager = _tensors(build(build_task_model(cfg), mesh, cfg, optimizer).model)
        after = torch.get_rng_state()
        torch.manual_seed(cfg.run.seed)
        built, setup = build_run(cfg, mesh, optimizer)
        got = _tensors(built.model)
        out.append({"names": sorted(eager) == sorted(got),
                    "equal": [n for n in eager if n in got and not torch.equal(eager[n], got[n])],
                    "rng": torch.equal(after, torch.get_rng_state()),
                    "peak": setup.peak_bytes, "model": setup.model_bytes})
    return out


def test_each_layout_materializes_its_pieces_bitwise(tmp_path, corpus):
    trees = [tiny_tree(tmp_path, corpus, model=m, run={"device": "cpu"},
                       parallel={"nproc": 2, **p}) for m, p in LAYOUTS]
    trees[-1]["data"] = {"source": "digits", "val_fraction": 0.2}
    results = run_world(_compare, 2, trees, timeout_s=240)
    for (model, parallel), tree, *ranks in zip(LAYOUTS, trees, *results):
        for rank, r in enumerate(ranks):
            where = f"{model} {parallel} rank {rank}"
            # timed on each build, the stages may be cut elsewhere the second time
            timed = parallel.get("pipeline_balance") == "time"
            assert (r["names"] or timed) and r["equal"] == [] and r["rng"], (where, r)
            if parallel.get("dp") is None and not timed:  # split: no rank held the whole model
                assert r["peak"] < r["model"], (where, r)
        # the dry run's figure, from shapes on the fake backend, is what rank 0 accounted
        assert setup_peak(config_from_dict(tree)).peak_bytes == ranks[0]["peak"], (model, parallel)


def test_the_set_up_peak_is_the_pieces_and_one_full_tensor(tiny):
    """The dry run's figures (gpt tp=2, on the fake backend): rank 0 holds its pieces plus at
    most the largest full tensor and the piece cut from it, well under the whole model."""
    from loomtrain.train.dryrun_text import dry_run

    m = {"d_model": 64, "n_layers": 4, "n_heads": 4, "vocab_size": 512}
    s = setup_peak(config_from_dict({"model": m, "parallel": {"nproc": 2, "tp": 2}}))
    assert s.largest_bytes == 4 * 512 * 64  # the embedding, tied to the head
    assert s.rank_bytes < s.peak_bytes <= s.rank_bytes + 1.5 * s.largest_bytes
    assert s.peak_bytes < 0.6 * s.model_bytes
    whole = setup_peak(config_from_dict({"model": m, "parallel": {"nproc": 2}}))
    assert whole.peak_bytes == whole.rank_bytes == whole.model_bytes  # dp: every rank all of it
    text = dry_run(tiny(parallel={"nproc": 2, "tp": 2}))
    assert "set-up: rank 0 holds at most" in text and "one full tensor at a time" in text


def _allocator_peak(fn) -> int:
    """The most CPU bytes `fn()` holds at once, from torch.profiler's allocation events: an
    op's own allocations at its start, the frees ([memory] events) when they happen."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage or e.name == "[memory]"),
                    key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}])
def test_the_allocator_measures_the_set_up_peak(parallel):
    """Rank 0 of a fake 2-rank world: what the allocator holds at most while materializing
    is the accounted peak, well under the whole model."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loomtrain.mesh import build_mesh
    from loomtrain.parallel import apply_tensor_parallel
    from loomtrain.parallel.pipeline import split_model
    from loomtrain.train.task import build_task_model

    cfg = config_from_dict({"model": {"d_model": 64, "n_layers": 4, "n_heads": 4},
                            "parallel": {"nproc": 2, **parallel}})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = build_mesh({"pp": cfg.parallel.pp, "tp": cfg.parallel.tp})
        model, record = record_init(lambda: build_task_model(cfg))
        model, _ = apply_tensor_parallel(model, mesh, cfg)
        if cfg.parallel.pp > 1:
            model = split_model(model, mesh, cfg)[0]
        accounted = []
        measured = _allocator_peak(lambda: accounted.append(materialize(model, record, "cpu")))
    finally:
        dist.destroy_process_group()
    assert measured == accounted[0] < 0.7 * record.model_bytes
