"""Bad configurations through the real CLI (in-process): exit 2, one paragraph starting with
"error:" that names the key, never a traceback. Plus --set parsing, the round trip of the
resolved config.toml, the dry run, and docs/config.md covering every key. Nothing here trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w

from conftest import refused as _refused
from conftest import tiny_tree
from loomtrain.cli import main
from loomtrain.train.config import Config, config_to_toml, load_config, parse_override

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _tiny_file(tmp_path: Path, corpus: Path, **sections) -> str:
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(tiny_tree(tmp_path, corpus, **sections)))
    return str(path)


def test_unknown_section(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("[trian]\nsteps = 3\n")
    err = _refused(capsys, ["train", "--dry-run", str(path)])
    assert "trian: unknown section" in err and "run, model, data, train, parallel" in err


def test_unknown_key_lists_the_valid_keys(capsys):
    err = _refused(capsys, ["train", "--dry-run", "--set", "train.stepz=3"])
    assert "train.stepz: unknown key" in err
    assert "valid keys in [train] are: steps, global_batch, micro_batch" in err


@pytest.mark.parametrize("override,expected", [
    ('train.steps="many"', "train.steps: Input should be a valid integer"),
    ("run.progress=3", "run.progress: Input should be a valid boolean"),
    ("model.name=7", "model.name: Input should be 'gpt', 'mlp' or 'llama' (got 7)"),
    ("run.device=tpu", "run.device: Input should be 'auto', 'cpu' or 'cuda' (got 'tpu')"),
    ("train.optimizer=lion", "train.optimizer: Input should be 'adamw' or 'sgd'"),
    ("run.name=true", "run.name: Input should be a valid string (got True); quote"),
    ("train.lr=inf", "train.lr: Input should be a finite number (got inf)"),
])
def test_wrong_type(capsys, override, expected):
    assert expected in _refused(capsys, ["train", "--dry-run", "--set", override])


@pytest.mark.parametrize("args,expected", [
    (["--nproc", "4", "--set", "parallel.dp=3"], "dp*tp*pp*cp = 3*1*1*1 = 3 must equal parallel.nproc=4"),
    (["--nproc", "4", "--set", "train.global_batch=10", "--set", "train.micro_batch=2"],
     "train.global_batch=10 must be divisible by dp*micro_batch = 4*2 = 8"),
    (["--set", "model.d_model=30", "--set", "model.n_heads=4"],
     "model.d_model=30 must be divisible by model.n_heads=4"),
    (["--nproc", "4", "--set", "parallel.ranks_per_node=3"],
     "parallel.ranks_per_node=3 must divide parallel.nproc=4"),
    (["--nproc", "0"], "parallel.nproc: Input should be greater than or equal to 1 (got 0)"),
    (["--set", "parallel.zero_stage=4"], "parallel.zero_stage: Input should be less than or equal to 3"),
    (["--set", "run.name="], "run.name: String should have at least 1 character"),
    (["--set", "model.name=\"llama\"", "--set", "model.activation=\"gelu_tanh\""],
     "model.activation='gelu_tanh' picks the GPT's GELU; model.name='llama' does not read it"),
    (["--set", "model.name=\"llama\"", "--set", "model.head_dim=7"],
     "model.head_dim = 7 must be even"),
    (["--set", "model.name=\"llama\"", "--set",
      "model.rope_scaling={rope_type=\"linear\", factor=2.0, low_freq_factor=2.0}"],
     "model.rope_scaling.low_freq_factor is a key of Llama 3's scaling; rope_type=\"linear\""),
])
def test_impossible_values(capsys, args, expected):
    assert expected in _refused(capsys, ["train", "--dry-run", *args])


@pytest.mark.parametrize("args,expected", [
    (["--nproc", "4", "--set", "comm.inter_node_gbps=0.5"],
     "comm.inter_node_gbps=0.5 simulates the link between nodes, but parallel.ranks_per_node=unset "
     "puts all parallel.nproc=4 ranks on one node: set parallel.ranks_per_node to a divisor"),
    (["--nproc", "4", "--set", "parallel.ranks_per_node=4", "--set", "comm.inter_node_gbps=1"],
     "parallel.ranks_per_node=4 puts all parallel.nproc=4 ranks on one node"),
    (["--nproc", "4", "--set", "parallel.ranks_per_node=2", "--set", "comm.inter_node_latency_ms=20"],
     "comm.inter_node_latency_ms=20.0 belongs to the simulated inter-node link, which is off: set "
     "comm.inter_node_gbps"),
    (["--set", "comm.inter_node_gbps=0"], "comm.inter_node_gbps: Input should be greater than 0"),
    (["--set", "comm.inter_node_latency_ms=-1"],
     "comm.inter_node_latency_ms: Input should be greater than or equal to 0"),
])
def test_simulated_link_refusals(capsys, args, expected):
    assert expected in _refused(capsys, ["train", "--dry-run", *args])


def test_simulated_link_between_nodes_is_accepted(tmp_path, corpus, capsys):
    path = _tiny_file(tmp_path, corpus)
    assert main(["train", "--dry-run", path, "--nproc", "4", "--set", "parallel.ranks_per_node=2",
                 "--set", "comm.inter_node_gbps=1", "--set", "comm.inter_node_latency_ms=20"]) == 0
    cfg = load_config(path, ["parallel.nproc=4", "parallel.ranks_per_node=2",
                             "comm.inter_node_gbps=1"])
    assert cfg.comm.inter_node_gbps == 1.0 and cfg.comm.inter_node_latency_ms == 0.0


# `_check_sequence`: context parallelism and packing (the default model: 4 heads, 128 tokens)
CP2 = ["--nproc", "4", "--set", "parallel.cp=2"]


@pytest.mark.parametrize("args,expected", [
    (CP2 + ["--set", 'parallel.cp_method="lasp"'],
     "parallel.cp_method='lasp' is for linear attention, but model.attention='softmax'"),
    (CP2 + ["--set", 'model.attention="linear"', "--set", 'parallel.cp_method="ring"'],
     "parallel.cp_method='ring' is for softmax attention"),
    (["--nproc", "4", "--set", "parallel.cp=4", "--set", "model.n_heads=2", "--set", "model.d_model=64",
      "--set", 'parallel.cp_method="ulysses"'], "model.n_heads=2 is not divisible by 4"),
    (CP2 + ["--set", "model.seq_len=30"], "model.seq_len=30 must be divisible by 4"),
    (CP2 + ["--set", "parallel.tp=2", "--set", 'parallel.cp_method="ulysses"', "--set",
            "model.n_heads=2"], "model.n_heads=2 over parallel.tp=2 leaves 1 per rank, not "
                                "divisible by 2"),
    (CP2 + ["--set", "parallel.tp=2", "--set", 'parallel.cp_method="ulysses"', "--set",
            "parallel.sequence_parallel=true", "--set", "model.seq_len=34"],
     "splits each cp rank's model.seq_len/parallel.cp = 17 tokens over parallel.tp=2"),
    (CP2 + ["--set", 'model.name="mlp"'], "model.name='mlp' has none"),
    (CP2 + ["--set", 'parallel.cp_method="auto"', "--set", "model.dropout=0.1"],
     'parallel.cp_method="auto" rewrites the model\'s causal scaled_dot_product_attention calls, '
     "without dropout"),
    (CP2 + ["--set", 'parallel.cp_method="auto"', "--set", "model.seq_len=30"],
     "model.seq_len=30 must be divisible by 4 for parallel.cp_method='auto'"),
    (CP2 + ["--set", "parallel.activation_budget_mb=1"],
     'parallel.activation_budget_mb is for parallel.schedule="optimal" or parallel.cp_method="auto"'),
    (["--set", 'parallel.cp_method="ring"'], "it needs parallel.cp > 1"),
    (["--set", "data.balance=true"], "data.balance=true deals the documents of packed rows to ranks: it needs data.packing=true"),
    (["--set", "data.balance=true", "--set", "data.packing=true", "--set", "model.attention=\"linear\""], "data.balance=true splits long documents with ring attention"),
    (CP2 + ["--set", 'parallel.cp_method="auto"', "--set", "parallel.activation_budget_mb=1"],
     'loom train --dry-run does not model parallel.cp_method="auto" with '
     "parallel.activation_budget_mb"),
])
def test_sequence_settings_refused(capsys, args, expected):
    assert expected in _refused(capsys, ["train", "--dry-run", *args])


def test_packing_needs_documents(tmp_path, capsys):
    single = tmp_path / "one.txt"
    single.write_text("x = 1\n" * 2000)
    err = _refused(capsys, ["train", "--dry-run", "--set", f'data.source="{single}"',
                            "--set", "data.packing=true"])
    assert "data.packing=true masks attention at document boundaries" in err


# `_check_pipeline`: the default model has 6 layers (embed, 4 blocks, head); on 4 ranks with
# pp 2, dp is 2 and the default batch (32 = 2 x 8 x 2) gives 2 micro-batches
PP2 = ["--nproc", "4", "--set", "parallel.pp=2"]


@pytest.mark.parametrize("args,expected", [
    (["--nproc", "2", "--set", "parallel.cp=2", "--set", 'parallel.cp_method="auto"', "--set",
      'parallel.recompute="full"'], 'parallel.cp_method="auto" checkpoints blocks itself'),
    (["--set", "parallel.microbatches=4"],
     "parallel.microbatches is a pipeline setting: it needs parallel.pp > 1"),
    ([*PP2, "--set", "parallel.microbatches=4"],
     "parallel.microbatches=4 must equal train.global_batch / (dp * train.micro_batch) = 32/(2*8) = 2; "
     "set train.micro_batch=4 (or leave parallel.microbatches unset)"),
    (["--nproc", "4", "--set", "parallel.pp=2", "--set", "parallel.cp=2",
      "--set", 'parallel.cp_method="auto"', "--set", "parallel.activation_budget_mb=1"],
     'parallel.cp_method="auto" under parallel.pp=2 chooses only the kernel: the pipeline '
     "recomputes per micro-batch itself"),
    ([*PP2, "--set", 'parallel.schedule="interleaved"'],
     'parallel.schedule="interleaved" needs parallel.virtual_stages >= 2 (got 1) and micro-batches '
     "divisible by parallel.pp=2 (got 2)"),
    ([*PP2, "--set", 'parallel.schedule="interleaved"',
      "--set", "parallel.virtual_stages=2", "--set", "train.micro_batch=16"],
     "needs parallel.virtual_stages >= 2 (got 2) and micro-batches divisible by parallel.pp=2 (got 1)"),
    ([*PP2, "--set", "parallel.virtual_stages=2"],
     "parallel.virtual_stages=2 is for parallel.schedule=\"interleaved\" (got '1f1b'); set it to 1"),
    ([*PP2, "--set", "model.name=mlp", "--set", 'parallel.recompute="selective"'],
     "parallel.recompute=\"selective\" recomputes the attention core; model.name='mlp' has none: use \"full\""),
    ([*PP2, "--set", "parallel.split_points=[2, 4]"],
     "parallel.split_points=[2, 4] must be 1 increasing layer indices between 1 and 5 (the model has 6 "
     "layers: embed, 4 blocks, head; pp*virtual_stages = 2 stages)"),
    ([*PP2, "--set", "parallel.split_points=[6]"],
     "parallel.split_points=[6] must be 1 increasing layer indices between 1 and 5"),
    (["--nproc", "8", "--set", "parallel.pp=8", "--set", "train.global_batch=8"],
     "parallel.pp*virtual_stages = 8 stages exceed the model's 6 layers (embed, 4 blocks, head)"),
])
def test_pipeline_refusals(capsys, args, expected):
    assert expected in _refused(capsys, ["train", "--dry-run", *args])


def test_pipeline_dry_run(capsys):
    assert main(["train", "--dry-run", "--nproc", "4", "--set", "parallel.pp=2"]) == 0
    out = capsys.readouterr().out
    assert "mesh pp=2 dp=2" in out and "pipeline: schedule 1f1b, 2 micro-batch(es)" in out
    assert "activations, stage 0 -> 1: 2 send over pp (2 ranks)" in out


@pytest.mark.parametrize("args,expected", [
    (["--set", "parallel.hierarchical=true"],
     "parallel.hierarchical=True needs ZeRO: set parallel.zero_stage to 1, 2 or 3"),
    (["--set", "parallel.offload_optimizer=true"],
     "parallel.offload_optimizer=True needs ZeRO: set parallel.zero_stage to 1, 2 or 3"),
    (["--set", 'parallel.shard_units=["blocks.*"]'],
     "parallel.shard_units=['blocks.*'] needs ZeRO: set parallel.zero_stage to 1, 2 or 3 (or train.precision"),
    (["--set", "parallel.zero_stage=2", "--set", 'parallel.optimizer_shard="dp"'],
     'parallel.optimizer_shard="dp" splits the optimizer state across nodes in hierarchical ZeRO'),
    (["--set", "parallel.prefetch=-1"], "parallel.prefetch: Input should be greater than or equal to 0"),
    (["--set", "train.precision=fp16"], "train.precision: Input should be 'fp32' or 'bf16'"),
])
def test_zero_options_that_need_zero(capsys, args, expected):
    assert expected in _refused(capsys, ["train", "--dry-run", *args])


@pytest.mark.parametrize("args,expected", [
    (["--set", "parallel.tp=2", "--set", "model.n_heads=3", "--set", "model.d_model=48"],
     "parallel.tp=2 must divide model.n_heads = 3"),
    (["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true", "--set", "model.seq_len=33"],
     "parallel.tp=2 must divide model.seq_len = 33"),
    (["--set", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel=true splits the layer norms of the GPT or the llama over the "
     "tensor-parallel ranks; it needs parallel.tp > 1"),
    (["--nproc", "4", "--set", "parallel.tp=2", "--set", "parallel.dp=3"],
     "dp*tp*pp*cp = 3*2*1*1 = 6 must equal parallel.nproc=4"),
])
def test_tensor_parallel_sizes_that_do_not_split(capsys, args, expected):
    assert expected in _refused(capsys, ["train", "--dry-run", *args])


def test_unit_patterns_that_match_nothing_are_refused_before_any_process_starts(tmp_path, capsys):
    runs = tmp_path / "runs"
    err = _refused(capsys, ["train", "--set", f'run.dir="{runs}"', "--set", "parallel.zero_stage=3",
                            "--set", 'parallel.shard_units=["layers.*"]'])
    assert "no module of the model matches the unit patterns ['layers.*']" in err
    assert "blocks.0" in err and not runs.exists()


@pytest.mark.parametrize("sets", [["trainsteps=3"], ["train.steps"], [".steps=3"], ["train..steps=3"],
                                  ["train.steps=1", "train.steps.x=2"]])
def test_malformed_set(capsys, sets):
    argv = ["train", "--dry-run"]
    for s in sets:
        argv += ["--set", s]
    err = _refused(capsys, argv)
    assert "--set" in err and ("section.key=value" in err or "is a value, not a section" in err)


def test_missing_config_file(tmp_path, capsys):
    err = _refused(capsys, ["train", str(tmp_path / "nope.toml")])
    assert "nope.toml" in err and "does not exist" in err


def test_invalid_toml(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[train\nsteps = \n")
    err = _refused(capsys, ["train", str(path)])
    assert "bad.toml" in err and "is not valid TOML" in err


@pytest.mark.parametrize("dry", [["--dry-run"], []])
def test_nonexistent_data_source(tmp_path, capsys, dry):
    # without --dry-run too: the corpus is read before any worker starts or folder is made
    runs = tmp_path / "runs"
    err = _refused(capsys, ["train", *dry, "--nproc", "1", "--set", f'run.dir="{runs}"',
                            "--set", f'data.source="{tmp_path / "missing.txt"}"'])
    assert "data.source=" in err and "missing.txt" in err and "does not exist" in err
    assert not runs.exists()


def test_dry_run_refuses_data_shorter_than_a_window(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 200)  # validation keeps the last 10% = 20 tokens
    err = _refused(capsys, ["train", "--dry-run", "--set", f'data.source="{short}"',
                            "--set", "data.val_fraction=0.1"])
    assert "the validation split has 20 tokens" in err and "model.seq_len+1 = 129" in err


@pytest.mark.parametrize("text,expected", [
    ("train.steps=5", 5), ("train.lr=1e-3", 1e-3), ("train.lr=3", 3), ("run.progress=false", False),
    ('run.name="my run"', "my run"), ("run.name=plain", "plain"),
    ("data.source=/tmp/x.txt", "/tmp/x.txt"), ("train.steps=1_000", 1000),
])
def test_set_values_are_toml_literals(text, expected):
    key, value = parse_override(text)
    assert key == text.split("=")[0].split(".")
    assert value == expected and type(value) is type(expected)


def test_set_values_reach_the_typed_config():
    cfg = load_config(None, ["train.steps=5", "train.lr=1e-3", "run.progress=false",
                             "run.name=2024", "parallel.bucket_mb=1", "parallel.nproc=4"])
    assert cfg.train.steps == 5 and cfg.train.lr == 1e-3 and cfg.run.progress is False
    assert cfg.run.name == "2024" and cfg.parallel.bucket_mb == 1.0
    assert cfg.parallel.dp_size == 4  # only nproc given: dp = nproc


def test_nproc_flag_wins_over_set(tmp_path, corpus, capsys):
    path = _tiny_file(tmp_path, corpus)
    assert main(["train", "--dry-run", path, "--set", "parallel.nproc=2", "--nproc", "4"]) == 0
    assert "world 4" in capsys.readouterr().out


@pytest.mark.parametrize("sections", [
    {},
    {"parallel": {"nproc": 4, "ranks_per_node": 2, "bucket_mb": 0.25}},
    {"parallel": {"nproc": 4, "dp": 4}, "train": {"optimizer": "sgd", "lr": 0.1, "beta1": 0.0}},
    {"model": {"name": "mlp", "dropout": 0.1}, "run": {"name": "2024", "device": "cpu"}},
    {"parallel": {"nproc": 4, "ranks_per_node": 2, "zero_stage": 3, "hierarchical": True,
                  "optimizer_shard": "dp", "prefetch": 2, "offload_optimizer": True,
                  "shard_units": ["blocks.*"]}, "train": {"precision": "bf16"}},
    {"parallel": {"nproc": 4, "ranks_per_node": 2},
     "comm": {"inter_node_gbps": 0.5, "inter_node_latency_ms": 20.0}},
    {"model": {"activation": "gelu_tanh"}},
    {"model": {"name": "llama", "d_model": 32, "n_heads": 4, "head_dim": 16,
               "rope_scaling": {"rope_type": "linear", "factor": 4.0}}},
])
def test_resolved_config_round_trips(tmp_path, corpus, sections):
    cfg = Config.model_validate(tiny_tree(tmp_path, corpus, **sections))
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg
    path.write_text(config_to_toml(Config()))
    assert load_config(path) == Config()


def test_dry_run_prints_mesh_memory_and_collectives(tmp_path, corpus, capsys):
    path = _tiny_file(tmp_path, corpus)
    assert main(["train", "--dry-run", path, "--nproc", "4"]) == 0
    out = capsys.readouterr().out
    assert "mesh pp=1 dp=4 cp=1 tp=1 (world 4, 1 node(s) of 4 ranks)" in out
    assert "memory per rank" in out and "activations" in out and "optimizer state" in out
    assert "collectives per optimizer step" in out and "all_reduce over dp (4 ranks)" in out
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_dry_run_refuses_an_invalid_config(tmp_path, corpus, capsys):
    path = _tiny_file(tmp_path, corpus)
    err = _refused(capsys, ["train", "--dry-run", path, "--nproc", "3"])
    assert "train.global_batch=8 must be divisible by dp*micro_batch = 3*2 = 6" in err


def _toml_literal(value) -> str:
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def test_docs_list_every_key_with_its_default():
    text = DOCS.read_text()
    for section, field in Config.model_fields.items():
        body = text.split(f"## [{section}]", 1)
        assert len(body) == 2, f"docs/config.md has no '## [{section}]' heading"
        body = body[1].split("\n## ", 1)[0]
        for key, info in field.annotation.model_fields.items():
            row = next((line for line in body.splitlines() if line.startswith(f"| `{key}` |")), None)
            assert row is not None, f"docs/config.md [{section}] does not document {key}"
            default = "unset" if info.default is None else f"`{_toml_literal(info.default)}`"
            assert row.split("|")[3].strip() == default, (section, key, row)
