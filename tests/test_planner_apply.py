"""planner/apply.py: a plan becomes a config that loads as the plan, `runnable` refuses what
`loom train` refuses (with its reason), `write_config` never overwrites a user's file, a
written config trains, and `parallel.plan = "auto"` runs the chosen plan."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomli_w

import loomtrain
from conftest import refused, tiny_tree
from loomtrain.errors import ConfigError, UserError
from loomtrain.planner.apply import (MARKER, choose_here, plan_config, resolve_auto, runnable,
                                     write_config)
from loomtrain.planner.plan import Plan
from loomtrain.planner.presets import ModelShape, preset
from loomtrain.train.config import config_from_dict, load_config
from loomtrain.train.metrics import read_metrics

DEFAULT = preset("default")  # 4 layers, d_model 256, seq 128, vocab 256
TINY = ModelShape("tiny", 2, 32, 2, 32, 256)  # conftest.tiny_tree's model


def _fp32(**fields) -> Plan:
    return Plan(precision="fp32", **fields)


# (plan, the config fields it must come back as); global batch 32 throughout
ROUND_TRIP = [
    (_fp32(dp=2, micro_batch=8, microbatches=2), {"dp_size": 2, "accumulation_steps": 2}),
    (_fp32(tp=2, micro_batch=4, microbatches=8, sequence_parallel=True),
     {"tp": 2, "sequence_parallel": True, "accumulation_steps": 8}),
    (_fp32(pp=2, micro_batch=4, microbatches=8, split=(2, 4), schedule="gpipe", recompute="full"),
     {"pp": 2, "split_points": [2], "schedule": "gpipe", "recompute": "full", "microbatches": 8}),
    (_fp32(pp=2, dp=2, micro_batch=2, microbatches=8, schedule="interleaved", virtual_stages=2,
           zero_stage=1, offload_activations=0.5),
     {"pp": 2, "dp_size": 2, "virtual_stages": 2, "zero_stage": 1, "offload_activations": 0.5}),
    (_fp32(cp=2, dp=2, micro_batch=4, microbatches=4), {"cp": 2, "dp_size": 2, "accumulation_steps": 4}),
    (Plan(dp=4, zero_stage=2, micro_batch=8, microbatches=1), {"zero_stage": 2, "precision": "bf16"}),
    (Plan(dp=2, zero_stage=3, micro_batch=4, microbatches=4, offload_optimizer=True),
     {"zero_stage": 3, "offload_optimizer": True, "accumulation_steps": 4}),
]


@pytest.mark.parametrize("plan, expected", ROUND_TRIP)
def test_plan_config_loads_as_the_plan(tmp_path, plan, expected):
    assert runnable(plan, DEFAULT, 32) is None
    path = write_config(tmp_path / "plan.toml", plan, DEFAULT, 32, header="a header\nsecond line")
    assert path.read_text().startswith(f"{MARKER}\n# a header\n# second line\n")
    cfg = load_config(path)
    p, t = cfg.parallel, cfg.train
    assert (p.nproc, p.dp_size, p.tp, p.pp, p.cp) == (plan.devices, plan.dp, plan.tp, plan.pp, plan.cp)
    assert (t.global_batch, t.micro_batch, t.precision) == (32, plan.micro_batch, plan.precision)
    assert cfg.accumulation_steps == plan.microbatches
    for key, value in expected.items():
        owner = cfg if key in ("accumulation_steps",) else t if key == "precision" else p
        assert getattr(owner, key) == value, key
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.seq_len) == (4, 256, 128)


def test_base_config_keeps_its_own_keys_and_loses_the_planned_ones(tmp_path, corpus):
    base = tiny_tree(tmp_path, corpus, parallel={"nproc": 4, "tp": 2, "bucket_mb": 0.5},
                     train={"lr": 1e-3})
    tree = plan_config(_fp32(dp=2, micro_batch=4, microbatches=1), TINY, 8, base)
    cfg = config_from_dict(tree)
    assert (cfg.parallel.nproc, cfg.parallel.tp, cfg.parallel.dp_size) == (2, 1, 2)
    assert cfg.parallel.bucket_mb == 0.5 and cfg.train.lr == 1e-3 and cfg.train.steps == 20
    assert base["parallel"]["tp"] == 2  # the caller's tree is not modified


@pytest.mark.parametrize("plan, reason", [
    (_fp32(tp=3, micro_batch=8, microbatches=4), "parallel.tp=3 must divide"),
    (_fp32(pp=2, micro_batch=4, microbatches=8, recompute="full",
           recompute_layers=(True, False, True, False)), "per-layer recompute"),
    (_fp32(dp=2, micro_batch=4, microbatches=2), "not the global batch 32"),
    (_fp32(pp=2, micro_batch=4, microbatches=8, split=(1, 2, 3)), "split"),
    (_fp32(pp=4, micro_batch=4, microbatches=8, schedule="interleaved", virtual_stages=2),
     "stages exceed"),
])
def test_runnable_refuses_what_loom_train_refuses(plan, reason, tmp_path):
    why = runnable(plan, DEFAULT, 32)
    assert why is not None and reason in why and "\n" not in why, why
    with pytest.raises(ValueError, match="would refuse"):
        write_config(tmp_path / "x.toml", plan, DEFAULT, 32)
    assert not (tmp_path / "x.toml").exists()


def test_woven_plans_are_runnable():
    """cp x ZeRO-3 (sharded over dp x cp) and recomputation outside a pipeline run in loom
    train, so the planner's space has them (issue 28)."""
    assert runnable(_fp32(cp=2, zero_stage=3, micro_batch=8, microbatches=4), DEFAULT, 32) is None
    assert runnable(_fp32(dp=2, micro_batch=8, microbatches=2, recompute="full"), DEFAULT,
                    32) is None


def test_runnable_checks_the_node_layout_of_a_base():
    """ranks_per_node=2 with dp=2 x tp=2 puts each tp pair on a node (fine); dp=4 on nodes of 3
    is refused by the config (3 does not divide 4); the mesh's own refusal (an axis group spread
    unevenly) cannot arise once ranks_per_node divides nproc on the (pp, dp, cp, tp) grid, so
    this checks the check runs and agrees."""
    base = {"parallel": {"ranks_per_node": 2}}
    assert runnable(_fp32(dp=2, tp=2, micro_batch=8, microbatches=2), DEFAULT, 32, base) is None
    why = runnable(_fp32(dp=3, micro_batch=2, microbatches=5), DEFAULT, 30, base)
    assert why is not None and "ranks_per_node=2 must divide parallel.nproc=3" in why


def test_write_config_never_overwrites_a_users_file(tmp_path):
    plan = _fp32(dp=2, micro_batch=8, microbatches=2)
    mine = tmp_path / "mine.toml"
    mine.write_text("[train]\nsteps = 5\n")
    with pytest.raises(ValueError, match="not written by loom plan"):
        write_config(mine, plan, DEFAULT, 32)
    assert mine.read_text() == "[train]\nsteps = 5\n"
    out = write_config(tmp_path / "plan.toml", plan, DEFAULT, 32)
    write_config(out, _fp32(dp=1, micro_batch=8, microbatches=4), DEFAULT, 32)  # its own: replaced
    assert load_config(out).parallel.nproc == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.toml", "plan.toml"]  # no temp left


def test_resolve_auto_applies_the_chosen_plan(tmp_path, corpus):
    cfg = config_from_dict(tiny_tree(tmp_path, corpus, parallel={"plan": "auto", "nproc": 2}))
    seen = []

    def choose(shape, nproc, batch, base):
        seen.append((shape, nproc, batch))
        return _fp32(tp=2, micro_batch=2, microbatches=4)

    out = resolve_auto(cfg, choose)
    assert seen == [(ModelShape("config", 2, 32, 2, 32, 256), 2, 8)]
    assert (out.parallel.plan, out.parallel.tp, out.parallel.dp_size) == ("none", 2, 1)
    assert out.run.name == "t" and out.data.source == cfg.data.source  # the rest kept
    assert resolve_auto(out, choose) is out and len(seen) == 1  # plan="none": unchanged
    with pytest.raises(ConfigError, match="does not run"):
        resolve_auto(cfg, lambda *a: _fp32(pp=2, micro_batch=2, microbatches=4, split=(1, 2, 3)))
    with pytest.raises(ConfigError, match="no plan"):
        resolve_auto(cfg, lambda *a: None)


def test_plan_auto_is_refused_where_the_planner_does_not_apply(tmp_path, corpus):
    with pytest.raises(ConfigError, match="plan='auto' with optim.name"):
        config_from_dict(tiny_tree(tmp_path, corpus, parallel={"plan": "auto"},
                                   optim={"name": "mezo"}))


@pytest.mark.timeout(150)
def test_written_config_trains(tmp_path, corpus):
    """`loom plan --write-config`'s file, run by `loom train` as is: a dp=2 plan of the tiny
    model on 2 processes for 2 steps."""
    base = tiny_tree(tmp_path, corpus, train={"steps": 2})
    plan = _fp32(dp=2, micro_batch=2, microbatches=2)
    path = write_config(tmp_path / "plan.toml", plan, TINY, 8, base, header="test")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(loomtrain.__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "loomtrain", "train", str(path)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "t"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    resolved = tomllib.loads((run_dir / "config.toml").read_text())
    assert (resolved["parallel"]["nproc"], resolved["parallel"]["dp"]) == (2, 2)


def _fake_search(monkeypatch, found: Plan | None, seen: list):
    """planner.search stood in for: it returns `found` if `accept` takes it, recording what it
    was asked (the real search is tested in its own file)."""
    from loomtrain.planner import calibrate, specs

    def search(shape, cluster, batch, top, space, accept, fix):
        assert fix == {"precision": "fp32"}  # the run's precision is kept, not searched
        seen.append((cluster.gpus, cluster.gpus_per_node, cluster.device.name, batch, space))
        ok = found is not None and accept(found) is None
        return SimpleNamespace(ranked=[SimpleNamespace(plan=found)] if ok else [])

    monkeypatch.setitem(sys.modules, "loomtrain.planner.search", SimpleNamespace(search=search))
    monkeypatch.setattr(specs, "load_device", lambda kind: specs.BUILTIN["h100-80g"])
    # this machine, calibrated or not: never measured here (apply.this_machine)
    monkeypatch.setattr(calibrate, "cpu_here",
                        lambda before=None: replace(specs.BUILTIN["a100-40g"], name="cpu-here"))


def test_choose_here_searches_this_machine_for_runnable_plans(monkeypatch, tmp_path, corpus):
    seen = []
    base = tiny_tree(tmp_path, corpus, run={"device": "cpu"}, parallel={"nproc": 4, "ranks_per_node": 2})
    _fake_search(monkeypatch, _fp32(dp=2, tp=2, micro_batch=2, microbatches=2), seen)
    assert choose_here(TINY, 4, 8, base) == _fp32(dp=2, tp=2, micro_batch=2, microbatches=2)
    assert seen == [(4, 2, "cpu-here", 8, "loom")]
    _fake_search(monkeypatch, _fp32(tp=4, micro_batch=2, microbatches=4), seen)  # tp 4 > 2 heads
    assert choose_here(TINY, 4, 8, base) is None


@pytest.mark.timeout(60)
def test_loom_train_plans_auto_before_the_dry_run(monkeypatch, tmp_path, corpus, capsys):
    from loomtrain import cli

    tree = tiny_tree(tmp_path, corpus, run={"device": "cpu"}, parallel={"plan": "auto", "nproc": 2})
    path = tmp_path / "auto.toml"
    path.write_text(tomli_w.dumps(tree))
    _fake_search(monkeypatch, _fp32(tp=2, micro_batch=2, microbatches=4), [])
    assert cli.main(["train", str(path), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert 'parallel.plan="auto" chose dp=1 tp=2 pp=1 cp=1' in out.err
    assert "mesh pp=1 dp=1 cp=1 tp=2" in out.out and "dp 1 x micro 2 x accumulation 4" in out.out
    _fake_search(monkeypatch, None, [])
    assert cli.main(["train", str(path), "--dry-run"]) == 2
    assert "no plan of this model runs on parallel.nproc=2" in capsys.readouterr().err


# the llama: 2 kv heads for 4 query heads, a tied head, keys the cost model does not read
# (rope_theta) that a planned config must keep
LLAMA = {"name": "llama", "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 48, "tie_embeddings": True,
         "rope_theta": 500000.0}


def test_llama_plans_become_llama_configs(tmp_path, corpus):
    """A preset's plan writes model.preset and the shape's keys, and the config builds the
    shape back; a llama config's plan keeps its own [model] keys."""
    from loomtrain.planner.presets import from_model_config

    shape = preset("llama-debug")
    plan = _fp32(tp=2, micro_batch=4, microbatches=8, sequence_parallel=True)
    cfg = load_config(write_config(tmp_path / "plan.toml", plan, shape, 32))
    assert (cfg.model.name, cfg.model.preset, cfg.parallel.tp) == ("llama", "llama-debug", 2)
    assert from_model_config(cfg.model, "llama-debug") == shape
    base = tiny_tree(tmp_path, corpus, model=LLAMA)
    mine = config_from_dict(base)
    tree = plan_config(_fp32(dp=2, micro_batch=4, microbatches=1), from_model_config(mine.model), 8, base)
    assert config_from_dict(tree).model == mine.model


def test_plan_auto_plans_a_llama_with_the_real_search(monkeypatch, tmp_path, corpus, capsys):
    """`parallel.plan = "auto"` on a llama config: the real search over the plans `loom train`
    runs, on a cpu-here spec written into a fresh cache folder (an A100's figures under that
    name), then the dry run of the chosen plan."""
    from loomtrain import cli
    from loomtrain.planner import specs

    spec = replace(specs.BUILTIN["a100-40g"], name="cpu-here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    specs.calibration_path().parent.mkdir(parents=True)
    specs.calibration_path().write_text(tomli_w.dumps(
        {k: v for k, v in spec.__dict__.items() if v is not None}))
    tree = tiny_tree(tmp_path, corpus, model=LLAMA, run={"device": "cpu"},
                     parallel={"plan": "auto", "nproc": 2})
    path = tmp_path / "auto.toml"
    path.write_text(tomli_w.dumps(tree))
    assert cli.main(["train", str(path), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert 'parallel.plan="auto" chose' in out.err and "model: llama" in out.out, out


def _auto_config(tmp_path, corpus) -> Path:
    path = tmp_path / "auto.toml"
    path.write_text(tomli_w.dumps(tiny_tree(tmp_path, corpus, run={"device": "cpu"},
                                            parallel={"plan": "auto", "nproc": 2})))
    return path


def test_plan_auto_calibrates_a_fresh_machine_once(monkeypatch, tmp_path, corpus, capsys,
                                                   calibration):
    """No calibration cached (an empty XDG_CACHE_HOME): `loom train` with plan = "auto"
    measures a quick one first, says so in one line, saves it where `loom bench calibrate`
    does and plans with it; the next run reads it and measures nothing. The measurement is
    the session's real quick calibration (conftest.py), handed back in place of a second
    ~25 s one; under torchrun, where every rank plans alone, nothing is measured: refused."""
    from loomtrain import cli
    from loomtrain.planner import calibrate, specs

    session = specs.device_from_table(
        tomllib.loads((calibration[0] / "loomtrain" / "cpu-here.toml").read_text()), "session")
    measured = []  # the `quick` argument of each calibration
    monkeypatch.setattr(calibrate, "calibrate",
                        lambda quick=False, effort=None: measured.append(quick) or session)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))
    path = _auto_config(tmp_path, corpus)
    assert cli.main(["train", str(path), "--dry-run"]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "no calibration of this machine yet" in line]
    assert len(said) == 1 and str(specs.calibration_path()) in said[0], err
    assert measured == [True] and 'parallel.plan="auto" chose' in err
    saved = specs.load_device("cpu-here")
    assert {**saved.__dict__, "source": ""} == {**session.__dict__, "source": ""}
    assert cli.main(["train", str(path), "--dry-run"]) == 0  # cached: read, not measured
    assert "no calibration" not in capsys.readouterr().err and measured == [True]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "1")
    err = refused(capsys, ["train", str(path), "--dry-run"])
    assert "under torchrun plans on every rank" in err
    assert measured == [True] and not specs.calibration_path().exists()


def _sampled_plans(shape: ModelShape, batch: int, n: int) -> list[Plan]:
    """`n` plans drawn (seeded) from everything search_space.py yields for `shape` on 8
    devices of one node (a cpu-here-named spec, so fp32 is searched too), offload variants
    included."""
    import random

    from loomtrain.planner import specs
    from loomtrain.planner.search_space import Space

    cluster = specs.ClusterSpec(replace(specs.BUILTIN["a100-40g"], name="cpu-here"), 8, 8)
    space = Space(shape, cluster, batch, {})
    plans = [replace(Plan(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=b, microbatches=m, **key), **v)
             for dp, tp, pp, cp in space.meshes() for b, m in space.micro_batches(dp)
             for key in space.compute_keys(tp, pp) for v in space.sync_variants(dp, tp, cp)]
    plans += [replace(p, **o) for p in plans for o in space.offload_variants(p)]
    return random.Random(0).sample(plans, n)


def _loom_train_takes(plan: Plan, shape: ModelShape, batch: int) -> bool:
    """Whether `loom train` takes the plan's config and splits its model: the config's
    validation, then tensor parallelism and the pipeline's split on the meta device over a
    fake world of the plan's ranks, as the dry run's set-up does (train/materialize.py
    `setup_peak`: no process)."""
    from loomtrain.train.materialize import setup_peak

    try:
        setup_peak(config_from_dict(plan_config(plan, shape, batch)))
    except (ValueError, UserError):
        return False
    return True


# (preset, plans sampled): the GPT-3 model's meta build takes ~0.3 s a plan, the others ~0.1 s
@pytest.mark.parametrize("name, n", [("default", 24), ("llama-debug", 24), ("gpt3-125m", 12)])
def test_the_loom_space_is_what_loom_train_takes(name, n):
    """`runnable` (the search's filter for space "loom" and its notes) says None exactly for
    the plans `loom train` takes, on a sample of the whole search space of a GPT, a llama
    and a GPT-3 preset (vocabulary 50257: tp pads it). (The refused plans in these samples:
    interleaved schedules whose microbatches pp does not divide, as Megatron refuses.)"""
    shape, batch = preset(name), 32
    verdicts = [(plan, runnable(plan, shape, batch) is None, _loom_train_takes(plan, shape, batch))
                for plan in _sampled_plans(shape, batch, n)]
    for plan, listed, takes in verdicts:
        assert listed == takes, (name, plan, runnable(plan, shape, batch))
    assert {listed for _, listed, _ in verdicts} == {True, False}  # the sample has both
    assert any(plan.tp > 1 and listed for plan, listed, _ in verdicts)


def test_gpt3_tp_plans_run_with_a_padded_vocabulary():
    """GPT-3's vocabulary (50257, prime) no longer keeps its tp plans out of `loom train`:
    tp pads it (models/config.py padded_vocab), and the cost model counts the
    padded rows each rank holds."""
    from loomtrain.planner import specs
    from loomtrain.planner.cost import estimate, padded
    from loomtrain.planner.search import search

    shape = preset("gpt3-1.3b")
    cluster = specs.ClusterSpec(specs.BUILTIN["h100-80g"], 8, 8)
    result = search(shape, cluster, 64, top=5, space="all", fix={"tp": 8},
                    accept=lambda plan: runnable(plan, shape, 64))
    assert len(result.ranked) == 5  # `loom plan` marks none "not run by `loom train` yet"
    assert all(note is None for note in result.notes.values()), result.notes
    assert padded(shape, 8).vocab_size == 50264 and padded(shape, 1) is shape
    plan = Plan(tp=8, micro_batch=1, microbatches=64)  # bf16: 2 bytes a weight
    more = estimate(shape, cluster, plan).memory["weights"] - estimate(
        replace(shape, vocab_size=50256), cluster, plan).memory["weights"]
    assert more == 2 * shape.d_model  # one more row on each rank (6283 against 6282), not 1/8
