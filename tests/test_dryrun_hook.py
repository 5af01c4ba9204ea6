"""The dry run's one hook, `Component.estimate`: a component outside the built-in list adds its
own memory row and collectives (train/dryrun.py knows no technique), sees what the components
before it in the apply order left, and can refuse the dry run."""

from __future__ import annotations

import pytest
from pydantic import Field

from conftest import tiny_tree
from loomtrain.component import FINISH, SPLIT, Component, Section, Switch
from loomtrain.errors import ConfigError
from loomtrain.estimate import MemoryRow, all_reduce
from loomtrain.train import dryrun
from loomtrain.train.components import COMPONENTS
from loomtrain.train.config import assemble, config_from_dict
from loomtrain.train.dryrun_text import dry_run


class ProbeKeys(Section):
    refuse: bool = False
    state_bytes: int = Field(1000, ge=0)


class Probe(Component):
    """Runs last (FINISH): after the split and the replica engine have estimated."""

    name = "probe"
    section, keys = "probe", ProbeKeys
    stage = FINISH
    seen: list = []

    @classmethod
    def estimate(cls, plan) -> None:
        if plan.cfg.probe.refuse:
            raise ConfigError("probe.refuse=true: the probe refuses the dry run")
        cls.seen.append((plan.replicated, plan.parameters, plan.activation_bytes))
        plan.memory_rows.append(MemoryRow("probe state", plan.cfg.probe.state_bytes, "a toy row"))
        plan.collectives.append(all_reduce("probe exchange", "dp", plan.mesh.size("dp"), 40))
        plan.parts[cls.name] = "probed"


class EarlyProbe(Component):
    """Runs first of the splits (SPLIT - 1): sees the whole model, nothing estimated yet."""

    name = "early_probe"
    switches = (Switch("probe.state_bytes", 1000),)  # on when the probe's bytes are changed
    stage = SPLIT - 1

    @classmethod
    def estimate(cls, plan) -> None:
        Probe.seen.append(("early", plan.replicated, plan.parameters))


WITH_PROBE = assemble((*COMPONENTS, Probe, EarlyProbe))


def test_a_component_adds_its_estimates_in_the_apply_order(tmp_path, corpus):
    tree = tiny_tree(tmp_path, corpus, parallel={"nproc": 2, "tp": 2},
                     train={"global_batch": 4}, probe={"state_bytes": 500})
    cfg = config_from_dict(tree, WITH_PROBE)
    Probe.seen.clear()
    est = dryrun.estimate(cfg)
    (early, probe) = Probe.seen
    # before the tp split the model is whole; after it, rank 0 holds its pieces, the tp
    # activations are set and the data-parallel engine has estimated
    assert early == ("early", False, est.model_parameters)
    assert probe == (True, est.parameters, est.memory.activation_bytes)
    assert est.parameters < est.model_parameters
    assert est.probe == "probed" and est.early_probe is None
    (row,) = est.memory.rows
    assert (row.name, row.nbytes) == ("probe state", 500)
    parts = [est.memory.parameter_bytes, est.memory.gradient_bytes, est.memory.optimizer_bytes,
             est.memory.activation_bytes, 500]
    assert est.memory.total_bytes == sum(parts)
    assert est.engine[-1].purpose == "probe exchange"  # after tp's collectives
    text = dry_run(cfg)
    assert "probe state" in text and "a toy row" in text and "probe exchange" in text


def test_a_component_refuses_the_dry_run(tmp_path, corpus):
    cfg = config_from_dict(tiny_tree(tmp_path, corpus, probe={"refuse": True}), WITH_PROBE)
    with pytest.raises(ConfigError, match="the probe refuses the dry run"):
        dryrun.estimate(cfg)
    with pytest.raises(AttributeError):
        dryrun.estimate(config_from_dict(tiny_tree(tmp_path, corpus))).no_such_component
