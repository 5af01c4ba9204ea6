"""Typed configuration, assembled from the components (train/components.py): one frozen
pydantic model per TOML section, unknown keys rejected; [run], [train] and [checkpoint] live
here. How `load_config` assembles and validates it: docs/architecture.md, "The component
interface"; every key: docs/config.md.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal

import tomli_w
from pydantic import Field, ValidationError, create_model, model_validator

from loomtrain.component import Component, Section
from loomtrain.composition import Composition
from loomtrain.data.config import DataConfig
from loomtrain.errors import ConfigError
from loomtrain.models.config import ModelConfig
from loomtrain.train.components import COMPONENTS


class RunConfig(Section):
    name: str = Field("default", min_length=1)  # empty would make run.dir itself the run folder
    dir: str = "runs"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(50, ge=1)
    eval_batches: int = Field(8, ge=1)
    progress: bool = True
    # consecutive steps with a non-finite loss or gradient before the run aborts
    max_nonfinite_steps: int = Field(5, ge=1)
    # record this step's compute/communication timeline into RUN_DIR/timeline.json (0: none)
    timeline_step: int = Field(0, ge=0)
    # times the launcher restarts the ranks after one dies (each restart resumes from the
    # newest checkpoint); under [lowcomm] a lost replica is restarted alone (docs/checkpoints.md)
    max_restarts: int = Field(0, ge=0)


class TrainConfig(Section):
    steps: int = Field(300, ge=1)
    global_batch: int = Field(32, ge=1)
    micro_batch: int = Field(8, ge=1)
    lr: float = Field(3e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.1, ge=0.0)
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float = Field(1.0, ge=0.0)  # 0 disables clipping
    optimizer: Literal["adamw", "sgd"] = "adamw"
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    # bf16: compute in bfloat16 with fp32 master weights, gradients reduced in fp32
    precision: Literal["fp32", "bf16"] = "fp32"
    # a run folder (its newest checkpoint) or a checkpoint folder: the model starts from its
    # weights, the rest of the run is new (step 0, optimizer, schedule); train/init_from.py
    init_from: str | None = Field(None, min_length=1)
    # every block's forward through torch.compile (parallel/compile.py); "inductor" generates
    # fused kernels (C++ on the CPU, Triton on CUDA), "aot_eager" runs the same traced graphs,
    # forward and backward, with torch's own kernels and compiles in seconds
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"


class CheckpointConfig(Section):
    every: int = Field(100, ge=0)  # 0: only at the end and on SIGINT/SIGTERM
    keep: int = Field(2, ge=1)


# the run's own sections, in the order they are written and listed
_CORE = {"run": RunConfig, "model": ModelConfig, "data": DataConfig, "train": TrainConfig}


class ConfigBase(Section):
    """What every assembled Config has: the components' rules run after the sections parse."""

    components: ClassVar[tuple[type[Component], ...]] = ()
    composition: ClassVar[Composition]

    @model_validator(mode="after")
    def _components(self) -> "ConfigBase":
        for component in self.components:
            component.validate(self)
        per_rank = self.batch_ranks * self.train.micro_batch
        if self.train.global_batch % per_rank:
            raise ValueError(
                f"train.global_batch={self.train.global_batch} must be divisible by "
                f"{self.batch_ranks_name}*micro_batch = {self.batch_ranks}*{self.train.micro_batch}"
                f" = {per_rank}")
        self.composition.check(self)
        return self

    @property
    def asgd(self):
        """The [async] section (`async` is a Python keyword: no attribute can have its name)."""
        return getattr(self, "async")

    def _batch_split(self) -> tuple[int, str]:
        for component in self.components:
            split = component.batch_ranks(self)
            if split is not None:
                return split
        return self.parallel.dp_size, "dp"

    @property
    def batch_ranks(self) -> int:
        """The ranks that share each step's global batch: dp, unless a component says
        otherwise (the asynchronous workers)."""
        return self._batch_split()[0]

    @property
    def batch_ranks_name(self) -> str:
        return self._batch_split()[1]

    @property
    def accumulation_steps(self) -> int:
        return self.train.global_batch // (self.batch_ranks * self.train.micro_batch)


def section_models(components) -> dict[str, type[Section]]:
    """{section: its pydantic model}: the run's own sections, then each component's (a shared
    section is one model inheriting every part, in component order), then [checkpoint]."""
    parts: dict[str, list[type[Section]]] = {}
    for component in components:
        if component.keys is not None:
            parts.setdefault(component.section, []).append(component.keys)
    models = dict(_CORE)
    for section, keys in parts.items():
        if section in models:
            raise AssertionError(f"[{section}] is a section of the run's own")
        owned = [k for part in keys for k in part.model_fields]
        if len(owned) != len(set(owned)):
            twice = sorted({k for k in owned if owned.count(k) > 1})
            raise AssertionError(f"[{section}] keys {twice} belong to two components")
        # pydantic lists inherited fields from the last base to the first
        models[section] = keys[0] if len(keys) == 1 else create_model(
            f"{section.capitalize()}Config", __base__=tuple(reversed(keys)), __module__=__name__)
    models["checkpoint"] = CheckpointConfig
    return models


def assemble(components) -> type[ConfigBase]:
    """The Config model of a run made of `components` (a section named by a keyword, such as
    [async], is a field of that name: read it with getattr)."""
    sections = section_models(components)
    model = create_model("Config", __base__=ConfigBase, __module__=__name__,
                         **{name: (m, m()) for name, m in sections.items()})
    model.components = tuple(components)
    model.composition = Composition.of(components)
    return model


Config = assemble(COMPONENTS)
ParallelConfig = Config.model_fields["parallel"].annotation


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value); the value is read as a TOML literal,
    and as a plain string when it is not one (so `--set data.source=/tmp/x.txt` works)."""
    key = text.split("=", 1)[0]
    if "=" not in text or "." not in key or not all(part.strip() for part in key.split(".")):
        raise ConfigError(
            f"--set {text!r} is not of the form section.key=value (for example "
            "--set train.steps=100)"
        )
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def _merge(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is a value, not a section")
        tree = node
    tree[path[-1]] = value


def _explain(err: ValidationError, config=None) -> str:
    config = config or Config
    sections = ", ".join(config.model_fields)
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            section = e["loc"][0] if len(e["loc"]) > 1 else None
            if section in config.model_fields:
                known = ", ".join(config.model_fields[section].annotation.model_fields)
                msg = f"unknown key; valid keys in [{section}] are: {known}"
            else:
                msg = f"unknown section; valid sections are: {sections}"
        elif "input" in e and e["type"] != "value_error":
            msg = f"{msg} (got {e['input']!r})"
            if e["type"] == "string_type":
                msg += "; quote text that TOML reads as a value, e.g. --set run.name='\"true\"'"
        # a combination rule names its keys itself: "model: model.d_model=30 ..." says it twice
        named = e["type"] == "value_error" and f"{loc}." in msg
        parts.append(f"{loc}: {msg}" if loc and not named else msg)
    return "invalid configuration: " + "; ".join(parts) + "."


def config_from_dict(tree: dict, config=None) -> ConfigBase:
    """The validated Config of `tree` (of the `config` model: default, the built-in
    components' `Config`)."""
    config = config or Config
    try:
        return config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err, config)) from None


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                config=None) -> ConfigBase:
    tree: dict = {}
    if path is not None:
        path = Path(path)
        try:
            if path.is_dir():
                raise ConfigError(f"config file {str(path)!r} is a directory (give a TOML file path)")
            if not path.is_file():
                raise ConfigError(f"config file {str(path)!r} does not exist (give a TOML file path)")
            raw = path.read_bytes()
        except OSError as err:  # no read permission (here or on a folder above), a failing device
            raise ConfigError(f"config file {str(path)!r} cannot be read ({err.strerror or err})") from None
        try:
            tree = tomllib.loads(raw.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    for text in overrides:
        key, value = parse_override(text)
        _merge(tree, key, value)
    return config_from_dict(tree, config)


def config_to_toml(cfg: ConfigBase) -> str:
    data = cfg.model_dump(exclude_none=True)
    return tomli_w.dumps(data)
