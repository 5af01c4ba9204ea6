"""The component interface on the config side (loomtrain/component.py, train/config.py): the
Config is assembled from the components' sections, each component's rules run, refusals come
from one table, and docs/composition.md is that table rendered. Pure: nothing trains."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pydantic import Field

from loomtrain.component import Component, Refusal, Section, Switch
from loomtrain.composition import Composition
from loomtrain.errors import ConfigError
from loomtrain.train.components import COMPONENTS
from loomtrain.train.config import Config, assemble, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]


class NoiseKeys(Section):
    # a toy technique: Gaussian noise on the gradients of the dp axis
    std: float = Field(0.0, ge=0.0)
    decay: float = Field(0.55, ge=0.0)


class GradientNoise(Component):
    name = "noise"
    section, keys = "noise", NoiseKeys
    switches = (Switch("noise.std", 0.0),)
    refuses = {"zeroth": Refusal("a zeroth-order step has no gradient to add noise to", yet=False)}

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.noise.decay != 0.55 and cfg.noise.std == 0.0:
            raise ValueError("noise.decay is a setting of the gradient noise, which is off: set "
                             "noise.std > 0 or leave it unset")


WITH_NOISE = assemble((*COMPONENTS, GradientNoise))


def test_docs_composition_is_the_table_rendered():
    spec = importlib.util.spec_from_file_location("render", ROOT / "tools" / "render_composition.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    assert (ROOT / "docs" / "composition.md").read_text() == render.render(), (
        "docs/composition.md differs from the components' table: run "
        "python tools/render_composition.py")


def test_a_components_section_joins_the_config_and_its_rules_run():
    cfg = config_from_dict({"noise": {"std": 0.1}}, WITH_NOISE)
    assert cfg.noise.std == 0.1 and cfg.noise.decay == 0.55
    assert "noise" not in Config.model_fields  # the built-in Config is unchanged
    with pytest.raises(ConfigError, match=r"noise.stdd: unknown key; valid keys in \[noise\] are: "
                                          r"std, decay"):
        config_from_dict({"noise": {"stdd": 0.1}}, WITH_NOISE)
    with pytest.raises(ConfigError, match="noise.decay is a setting of the gradient noise"):
        config_from_dict({"noise": {"decay": 0.3}}, WITH_NOISE)
    with pytest.raises(ConfigError, match="noise: unknown section"):
        config_from_dict({"noise": {"std": 0.1}})


def test_a_refusal_names_both_switches_the_reason_and_the_valid_choice():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"noise": {"std": 0.1}, "optim": {"name": "mezo"}}, WITH_NOISE)
    assert str(err.value) == (
        "invalid configuration: noise.std=0.1 with optim.name='mezo' is not supported: a "
        "zeroth-order step has no gradient to add noise to (optim.name='backprop').")
    assert WITH_NOISE.composition.refusal("zeroth", "noise")[0] == "noise"


class PipelineNoise(GradientNoise):
    # the toy refuses the pipeline only above a noise level (a conditional refusal)
    name = "noise"
    refuses = {"pipeline": Refusal("loud noise breaks the schedule", partly="std > 1",
                                   when=lambda cfg: cfg.noise.std > 1, allowed="noise.std <= 1")}


def test_a_refusal_with_a_condition_refuses_only_those_settings():
    config = assemble((*COMPONENTS, PipelineNoise))
    tree = {"parallel": {"nproc": 2, "pp": 2}, "noise": {"std": 0.5}}
    assert config_from_dict(tree, config).noise.std == 0.5  # quiet noise runs in the pipeline
    with pytest.raises(ConfigError, match=r"noise.std=2.0 with parallel.pp=2 is not supported "
                                          r"yet: loud noise breaks the schedule \(noise.std <= 1\)"):
        config_from_dict({**tree, "noise": {"std": 2.0}}, config)


def test_the_table_is_built_from_both_sides_and_refuses_unknown_or_doubled_pairs():
    table = Config.composition
    assert table.refusal("zero", "sparsity") == table.refusal("sparsity", "zero")
    assert table.refusal("tensor", "zero") is None  # tp x ZeRO runs
    assert table.refusal("tensor", "pipeline") is None  # tp x pp runs
    assert table.refusal("lowcomm", "sparsity")[0] == "sparsity"  # declared there

    class Typo(Component):
        name = "typo"
        switches = (Switch("run.seed", 0),)
        refuses = {"tensr": Refusal("x")}

    with pytest.raises(AssertionError, match="refuses unknown 'tensr'"):
        Composition.of((*COMPONENTS, Typo))

    class Twice(Component):
        name = "twice"
        switches = (Switch("run.seed", 0),)
        refuses = {"noise": Refusal("x")}

    class Noise2(GradientNoise):
        refuses = {"twice": Refusal("y")}

    with pytest.raises(AssertionError, match="refused twice"):
        Composition.of((Twice, Noise2))


def test_a_key_owned_by_two_components_is_refused_at_assembly():
    class Tp(Section):
        tp: int = 1

    class Stolen(Component):
        name = "stolen"
        section, keys = "parallel", Tp

    with pytest.raises(AssertionError, match=r"\[parallel\] keys \['tp'\] belong to two"):
        assemble((*COMPONENTS, Stolen))


def test_every_component_is_named_once_and_its_switch_keys_exist():
    names = [c.name for c in COMPONENTS]
    assert len(names) == len(set(names))
    cfg = Config()
    for c in COMPONENTS:
        for switch in c.switches:
            section, key = switch.key.split(".")
            assert key in type(getattr(cfg, section)).model_fields, switch.key
            assert not switch.active(cfg), f"{c.name} is on by default"


def test_a_toml_file_loads_through_the_assembled_model(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[noise]\nstd = 0.5\n")
    assert load_config(path, ["noise.decay=0.9"], WITH_NOISE).noise.decay == 0.9
