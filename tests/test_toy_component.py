"""A technique added without touching the hubs (issue 25): gradient noise on the dp axis
(Neelakantan et al. 2015, "Adding Gradient Noise Improves Learning for Very Deep Networks":
Gaussian noise of variance eta / (1 + t)^gamma added to the gradient), written entirely in
this file as a Component with its own [noise] section, state and metric. It trains,
checkpoints and resumes through `run.run`, what `loom train` runs on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import Field

from conftest import tiny_tree
from harness import run_world
from loomtrain.component import FINISH, Built, Component, Refusal, Section, Switch
from loomtrain.train import checkpoint, run
from loomtrain.train.components import COMPONENTS
from loomtrain.train.config import assemble, config_from_dict
from loomtrain.train.metrics import read_metrics


class NoiseKeys(Section):
    eta: float = Field(0.0, ge=0.0)  # the noise variance at t = 0; 0: off
    gamma: float = Field(0.55, ge=0.0)  # the variance decays as 1 / (1 + t)^gamma


class GradientNoise(Component):
    """The same noise on every dp rank (one seed), added to the all-reduced gradient before
    clipping, so the replicas stay identical; its generator is its checkpointed state."""

    name = "noise"
    section, keys = "noise", NoiseKeys
    switches = (Switch("noise.eta", 0.0),)
    refuses = {"zeroth": Refusal("a zeroth-order step has no gradient", yet=False),
               "sparsity": Refusal("sparse training owns the step's gradient passes")}
    stage = FINISH
    KEYS = ("noise.generator", "noise.step")

    @classmethod
    def apply(cls, built: Built) -> None:
        generator = torch.Generator().manual_seed(built.cfg.run.seed + 1234)
        built.parts[cls.name] = {"generator": generator, "t": 0, "std": 0.0}

    @classmethod
    def gradient(cls, built: Built, forward_backward, forward_loss):
        loss_sum = forward_backward()
        part, keys = built.parts[cls.name], built.cfg.noise
        part["std"] = (keys.eta / (1 + part["t"]) ** keys.gamma) ** 0.5
        part["t"] += 1
        for p in built.model.parameters():
            if p.grad is not None:
                p.grad.add_(torch.randn(p.grad.shape, generator=part["generator"]) * part["std"])
        return loss_sum

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        return {"noise_std": built.parts[cls.name]["std"]}

    @classmethod
    def state(cls, built: Built, rank: int) -> dict:
        part = built.parts[cls.name]
        return {"noise.generator": part["generator"].get_state(),
                "noise.step": torch.tensor(part["t"])}

    @classmethod
    def placeholders(cls, built: Built, path, saved: dict, rank: int) -> dict:
        missing = [k for k in cls.KEYS if k not in saved]
        if missing:
            raise ValueError(f"it holds no gradient-noise state ({missing[0]})")
        return {k: torch.empty(saved[k][0], dtype=saved[k][1]) for k in cls.KEYS}

    @classmethod
    def load_state(cls, built: Built, state: dict, rank: int) -> None:
        part = built.parts[cls.name]
        part["generator"].set_state(state["noise.generator"])
        part["t"] = int(state["noise.step"])


WITH_NOISE = assemble((*COMPONENTS, GradientNoise))
STEPS = {"train": {"steps": 6}, "checkpoint": {"every": 3}, "parallel": {"nproc": 2}}


def _keep_group(mesh) -> None:
    """run.shutdown, kept from leaving the harness's process group between runs."""


def _four_runs(rank, world, trees):
    run.shutdown = _keep_group
    dirs = {}
    for label, tree in trees.items():
        cfg = config_from_dict(tree, WITH_NOISE)
        dirs[label] = Path(cfg.run.dir) / cfg.run.name
        if label == "resumed":  # the same run again, from its step-3 checkpoint
            run.run(cfg, dirs[label], checkpoint.step_dir(dirs["stopped"], 3))
        else:
            run.run(cfg, dirs[label], None)
    if rank:
        return None
    return {label: read_metrics(d) for label, d in dirs.items()}


@pytest.mark.timeout(240)
def test_a_technique_in_a_test_file_trains_checkpoints_and_resumes(tmp_path, corpus):
    def tree(name, eta, run_dir):
        t = tiny_tree(tmp_path, corpus, **STEPS, noise={"eta": eta})
        t["run"].update(name=name, dir=str(tmp_path / run_dir))
        return t

    trees = {"plain": tree("plain", 0.0, "a"), "noisy": tree("noisy", 0.02, "a"),
             "stopped": tree("noisy", 0.02, "b"), "resumed": tree("noisy", 0.02, "b")}
    metrics = run_world(_four_runs, 2, trees, timeout_s=200)[0]
    noisy, resumed = metrics["noisy"], metrics["resumed"]
    # its metric is in every record, and follows its schedule (eta / (1 + t)^gamma)^0.5
    assert [r["noise_std"] for r in noisy] == pytest.approx(
        [(0.02 / (1 + t) ** 0.55) ** 0.5 for t in range(6)])
    assert "noise_std" not in metrics["plain"][0]  # off: no hook ran
    # it changes training, and a resume restores its generator: the resumed run's losses
    # are the uninterrupted run's, bitwise (a fresh generator would draw other noise)
    assert [r["loss"] for r in noisy] != [r["loss"] for r in metrics["plain"]]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in noisy]
    # its state is in the checkpoint, under its own keys, beside the model and optimizer
    saved = checkpoint.saved_tensors(checkpoint.step_dir(tmp_path / "b" / "noisy", 6), "noise.")
    assert set(saved) == set(GradientNoise.KEYS)


def test_its_section_and_refusals_are_the_configs():
    assert config_from_dict({"noise": {"eta": 0.1}}, WITH_NOISE).noise.gamma == 0.55
    assert WITH_NOISE.composition.refusal("noise", "sparsity")[0] == "noise"
