"""`loom plan` end to end (planner/command.py): the ranked table as JSON with every field the
issue names, a bad --fix refused with exit 2, and --write-config giving a config that loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loomtrain.train.config import load_config

pytestmark = pytest.mark.timeout(120)
LOOM = [sys.executable, "-m", "loomtrain", "plan"]
KEYS = {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "mem_per_device_bytes",
        "comm_bytes_per_step"}


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LOOM, *args], capture_output=True, text=True, timeout=100)


def test_json_ranks_plans_with_every_field():
    out = _plan("--model", "gpt3-1.3b", "--gpus", "16", "--top", "4", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    plans = doc["plans"]
    assert 1 <= len(plans) <= 4 and doc["devices"] == 16
    for row in plans:
        assert KEYS <= set(row), set(row)
        assert row["mem_per_device_bytes"] <= 80e9 and 0 < row["mfu"] < 1
    times = [row["step_time_s"] for row in plans]
    assert times == sorted(times)


def test_fix_evaluates_the_given_layout_and_refuses_a_bad_one():
    out = _plan("--model", "gpt3-1.3b", "--gpus", "16", "--fix", "dp=4,tp=4", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(r["settings"]["dp"] == 4 and r["settings"]["tp"] == 4
               for r in json.loads(out.stdout)["plans"])
    bad = _plan("--model", "gpt3-1.3b", "--gpus", "16", "--fix", "tp=3")
    assert bad.returncode == 2 and "error" in bad.stderr.lower()
    typo = _plan("--model", "gpt3-1.3b", "--gpus", "16", "--fix", "tensor=2")
    assert typo.returncode == 2 and "KEY=VALUE" in typo.stderr


def test_write_config_gives_a_config_loom_train_loads(tmp_path):
    path = tmp_path / "planned.toml"
    out = _plan("--model", "default", "--gpus", "2", "--gpu", "a100-80g", "--write-config", str(path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert path.read_text().startswith("# written by loom plan")
    cfg = load_config(path)
    assert cfg.parallel.nproc == 2
    assert cfg.parallel.dp_size * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp == 2



def test_loom_train_plan_auto_flag_plans_with_the_real_search(tmp_path):
    """`loom train --plan auto --dry-run`: the real search over the plans `loom train` runs, on
    a cpu-here spec written into a fresh cache folder (an A100's figures under that name)."""
    import dataclasses
    import os

    import tomli_w

    from loomtrain.planner.specs import BUILTIN

    spec = dataclasses.replace(BUILTIN["a100-40g"], name="cpu-here")
    table = {k: v for k, v in dataclasses.asdict(spec).items() if v is not None}
    (tmp_path / "loomtrain").mkdir()
    (tmp_path / "loomtrain" / "cpu-here.toml").write_text(tomli_w.dumps(table))
    out = subprocess.run([sys.executable, "-m", "loomtrain", "train", "--plan", "auto", "--nproc", "2",
                          "--set", "run.device=\"cpu\"", "--dry-run"], capture_output=True, text=True,
                         timeout=100, cwd=tmp_path, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert 'parallel.plan="auto" chose' in text and "precision=fp32" in text, text[:2000]
    # the best plan here is cp 2 under ZeRO-2, which the dry run models: the ring's sends
    assert "cp=2" in text and "send over cp (2 ranks)" in text, text[:2000]


def test_loom_plan_takes_llama_presets_and_configs(tmp_path, capsys):
    """`loom plan --model llama3-70b` ranks plans of the published shape (in process: the
    subprocesses above pay the imports); a llama config's best plan is written as a config
    that builds the same model."""
    import tomli_w

    from loomtrain.cli import main
    from loomtrain.planner.presets import from_model_config

    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-80g", "--top", "3",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["params"] == 70_553_706_496 and doc["model"]["kv_heads"] == 8
    assert doc["plans"] and all(row["mem_per_device_bytes"] <= 80e9 for row in doc["plans"])
    config, planned = tmp_path / "llama.toml", tmp_path / "planned.toml"
    config.write_text(tomli_w.dumps({"model": {"name": "llama", "n_heads": 4, "n_kv_heads": 1,
                                               "qk_norm": True, "rope_theta": 1e6}}))
    assert main(["plan", "--model", str(config), "--gpus", "2", "--gpu", "a100-80g",
                 "--write-config", str(planned)]) == 0
    mine, written = load_config(config).model, load_config(planned).model
    assert from_model_config(written, "llama") == from_model_config(mine, "llama")
    assert (written.rope_theta, written.ffn_hidden) == (1e6, mine.ffn_width)  # 768: resolved
