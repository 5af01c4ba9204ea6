"""The one interface every technique implements, `Component`: its keys, switch, validator,
refusals, its step of building the run (`stage`, `apply`), its hooks in the loop and its
checkpoint state; `Built`, what the components transform; the apply stages. The hubs
(train/config.py, apply.py, trainer.py) call only this (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _leaf_types(annotation) -> set:
    """The plain types a key's annotation is made of: `int | None` -> {int, NoneType},
    `list[tuple[float, float]]` -> {list, tuple, float}, `Literal["a"]` -> {str}."""
    if get_origin(annotation) is Literal:
        return {type(v) for v in get_args(annotation)}
    leaves = {get_origin(annotation) or annotation}
    for arg in get_args(annotation):
        if arg is not Ellipsis:
            leaves |= _leaf_types(arg)
    return leaves


def _bool_for_number(value, leaves: set) -> bool:
    """Whether `value` (or an item of it) is a bool where `leaves` want a number, not a bool."""
    if isinstance(value, bool):
        return bool(leaves & {int, float}) and bool not in leaves
    if isinstance(value, (list, tuple)):
        return any(_bool_for_number(v, leaves) for v in value)
    return False


class Section(BaseModel):
    """A configuration section (or a component's part of one): frozen, unknown keys refused."""

    # numbers are accepted for text keys, so `--set run.name=2024` names the run "2024"
    # inf/nan are refused: no key means "unbounded" by them, and inf breaks timedelta(timeout_s)
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        """A bool is not a number: pydantic's lax mode reads `true` as 1, so `--set
        train.steps=true` would train one step. Strict mode would refuse it, but also a TOML
        array for a tuple key, so every section refuses it here, for every number key."""
        leaves = _leaf_types(cls.model_fields[info.field_name].annotation)
        if _bool_for_number(value, leaves):
            kind = "a number" if float in leaves else "an integer"
            raise ValueError(f"{kind} is expected, not a boolean (got {value!r})")
        return value


def value_of(cfg, key: str) -> Any:
    """The value of `section.key` in a Config (`async` is read through its attribute name)."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def literal(value: Any) -> str:
    """How a value is named in a message: `2`, `'bf16'`, `True`, `['blocks.*']`."""
    return repr(list(value) if isinstance(value, tuple) else value)


# The apply order (TorchTitan's): split the model (tensor and sequence parallel), cut it into
# pipeline stages, context parallel; then the optimizer is built over what this rank holds;
# then what the replicas need (a compressor), and one replica engine wraps model and
# optimizer: the low-communication replicas, ZeRO, or plain data parallelism, the first of
# them that applies.
SPLIT, PIPELINE, CONTEXT, OPTIMIZER, PREPARE, REPLICATE, FINISH = 10, 20, 30, 40, 45, 50, 60


@dataclass
class Built:
    """What the components transform as they apply: the model, from stage OPTIMIZER on the
    optimizer, the loss its outputs need, and what one component hands a later one."""

    model: Any
    mesh: Any
    cfg: Any
    loss_sum: Callable | None = None  # (logits, targets) -> the token-summed loss
    optimizer: Any = None
    compressor: Any = None  # for the replica engine (stage PREPARE)
    replicated: bool = False  # a replica engine has wrapped model and optimizer
    layout: Any = None  # the checkpoint layout (parallel/state.py) of the engine that wrapped it
    parts: dict = field(default_factory=dict)  # each component's runtime objects, by its name
    applied: list = field(default_factory=list)  # the components that applied, in stage order
    meta: dict = field(default_factory=dict)  # plain values every checkpoint's loom.json holds
    materializer: Callable | None = None  # makes a meta-device model real (train/apply.py)
    step_tokens: float = 1.0  # what this step's losses are divided by (set before before_step)

    def local(self, batch: tuple) -> tuple:
        """(inputs, targets) of this rank from a loaded batch: every applied component's
        `local_batch` in turn (under context parallelism or packing the sequence runtime
        keeps this rank's tokens of the full rows and notes their documents)."""
        for component in self.applied:
            batch = component.local_batch(self, batch)
        return batch

    def materialize(self, model=None) -> None:
        """Before reading values: `model` (or `self.model`), split on the meta device, becomes
        this rank's real tensors. Once; a no-op for a model built real."""
        materializer, self.materializer = self.materializer, None
        if materializer is not None:
            materializer(self.model if model is None else model)


@dataclass(frozen=True)
class Switch:
    """The key that turns a component on: on while its value is not `off` (or, with `on`
    given, while it is one of those values)."""

    key: str
    off: Any = None
    on: tuple = ()
    show_value: bool = True  # False for values too long to repeat (a path)

    def active(self, cfg) -> bool:
        value = value_of(cfg, self.key)
        return value in self.on if self.on else value != self.off

    def named(self, cfg) -> str:
        if not self.show_value:
            return self.key
        return f"{self.key}={literal(value_of(cfg, self.key))}"

    def allowed(self) -> str:
        return f"{self.key}={literal(self.off)}" if not self.on else f"{self.key} not " + \
            " or ".join(literal(v) for v in self.on)


@dataclass(frozen=True)
class Refusal:
    """Why a component does not run with another. `when(cfg)` narrows the refusal to some of
    the other's settings (`partly` names them in the table); `yet=False` marks what is not
    built by design (the maths or the hardware forbid it), not merely not built yet."""

    reason: str
    yet: bool = True
    when: Callable[[Any], bool] | None = None
    partly: str = ""
    allowed: str = ""  # the valid choice, where the other's off value is not the only one


class Component:
    """A technique as the hubs see it. Subclasses set the class attributes; `validate` holds
    the rules between its own keys and the rest of the config (raise ValueError with one
    paragraph naming the keys and the valid choices)."""

    name: ClassVar[str]
    # the section its keys live in and the pydantic model of its keys there (None: it has no
    # keys of its own, e.g. bf16 is train.precision)
    section: ClassVar[str | None] = None
    keys: ClassVar[type[Section] | None] = None
    switches: ClassVar[tuple[Switch, ...]] = ()  # any one on turns it on; none: always on
    refuses: ClassVar[dict[str, Refusal]] = {}  # other component's name -> why not
    summary: ClassVar[str] = ""  # one line for the composition table
    stage: ClassVar[int | None] = None  # when `apply` runs (SPLIT ... REPLICATE); None: never

    @classmethod
    def active(cls, cfg) -> bool:
        return not cls.switches or any(s.active(cfg) for s in cls.switches)

    @classmethod
    def switch(cls, cfg) -> Switch:
        """The switch that turned it on (the first, for one that is always on)."""
        return next((s for s in cls.switches if s.active(cfg)), cls.switches[0])

    @classmethod
    def validate(cls, cfg) -> None:
        """Rules between its keys and the rest of the config, checked whatever its switch
        (a key of it set while it is off is refused here too)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        """Whether `apply` runs for this config (by default: while it is on)."""
        return cls.active(cfg)

    @classmethod
    def apply(cls, built: Built) -> None:
        """Its step of building the run: transform `built` in place, over its mesh axes."""

    @classmethod
    def estimate(cls, plan) -> None:
        """Its part of `loom train --dry-run` (the `loomtrain.estimate.DryRunPlan` of rank 0,
        on a meta model), where it applies, in the apply order; ConfigError: it refuses."""

    # --- the run: the loop calls these on the components that applied (Built.applied) ---
    @classmethod
    def describe(cls, built: Built) -> str | None:
        """A line for the run's log once built (what an automatic choice chose)."""
        return None

    @classmethod
    def loaded_ranks(cls, cfg, mesh) -> list[int] | None:
        """The dp ranks whose rows this rank loads, where this component decides (a pool
        dealt by work loads every dp rank's); None: its own."""
        return None

    @classmethod
    def local_batch(cls, built: Built, batch: tuple) -> tuple:
        """This rank's part of a loaded batch (context parallelism keeps its tokens)."""
        return batch

    @classmethod
    def train_step(cls, built: Built, batches, global_tokens: float, loss_fn):
        """The whole optimizer step, where this component owns it: (loss sum, grad norm,
        stepped); None: the loop's own step."""
        return None

    @classmethod
    def forward_backward(cls, built: Built, batches, global_tokens: float, loss_fn):
        """Every micro-batch's forward and backward, where this component runs them (a
        pipeline schedule): this rank's loss sum; None: the loop's own."""
        return None

    @classmethod
    def gradient(cls, built: Built, forward_backward, forward_loss):
        """The step's gradient from `forward_backward()` and `forward_loss()` passes, where
        this component takes more than one (SAM): the loss sum; None: one pass."""
        return None

    @classmethod
    def forward_only(cls, built: Built, x):
        """The evaluation forward, where this component runs it: (output or None off the
        pipeline's last stage,); None: the model's own."""
        return None

    @classmethod
    def loss_tokens(cls, built: Built, local_tokens: int, global_tokens: float) -> float | None:
        """What each loss is divided by, where this component decides (replicas that step
        apart divide by their own tokens); None: the global count."""
        return None

    @classmethod
    def before_step(cls, built: Built, step: int) -> None:
        """Step `step` (from 0) begins."""

    @classmethod
    def after_update(cls, built: Built, stepped: bool) -> None:
        """The optimizer has stepped (or skipped a non-finite step), before zero_grad."""

    @classmethod
    def after_step(cls, built: Built, done: int, last: bool, loss_sum, loss_tokens: float) -> None:
        """Step `done` (from 1) is over."""

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        """Its figures for a logged step's record (more on an evaluated step)."""
        return {}

    @classmethod
    def before_evaluate(cls, built: Built) -> None:
        """What it must finish before the model is evaluated (micro-batches in flight)."""

    @classmethod
    def before_save(cls, built: Built) -> None:
        """What it must finish before the model is saved (one model from the replicas)."""

    @classmethod
    def state(cls, built: Built, rank: int) -> dict:
        """Its tensors for a checkpoint, under keys of its own (beside the layout's model and
        optimizer)."""
        return {}

    @classmethod
    def placeholders(cls, built: Built, path, saved: dict, rank: int) -> dict:
        """Tensors for `state`'s entries of checkpoint `path` to load into; `saved`: the
        checkpoint's {key: (shape, dtype)}. ValueError (with the reason) if they cannot."""
        return {}

    @classmethod
    def load_state(cls, built: Built, state: dict, rank: int) -> None:
        """Take `placeholders`' tensors, filled from the checkpoint (ValueError if they do
        not fit)."""

    @classmethod
    def start_timeline(cls, built: Built, timeline) -> bool:
        """Record this step into `timeline` (loomtrain.timeline.Timeline), if this component
        records one: True."""
        return False

    @classmethod
    def write_timeline(cls, built: Built, timeline, run_dir, step: int, mesh) -> dict:
        """Write the recorded step (its files under `run_dir`); returns figures for the
        step's record."""
        return {}

    @classmethod
    def batch_ranks(cls, cfg) -> tuple[int, str] | None:
        """(the ranks that share each step's global batch, what to call them), where this
        component decides it (None: the dp ranks do)."""
        return None


def start_engine_timeline(built: Built, timeline) -> bool:
    """An engine that records its own spans (`model.timeline`: ZeRO's units, HPSGD's sync)."""
    if not hasattr(built.model, "timeline"):
        return False
    built.model.timeline = timeline
    return True


def write_engine_timeline(built: Built, timeline, run_dir, step: int, mesh) -> dict:
    built.model.timeline = None
    if mesh.rank == 0:
        timeline.write(run_dir / "timeline.json", step=step + 1, rank=0)
    return {}


def changed_keys(section: BaseModel, keys=None) -> list[str]:
    """The keys of `section` set away from their defaults, in declaration order."""
    fields = type(section).model_fields
    return [k for k in (keys if keys is not None else fields)
            if getattr(section, k) != fields[k].default]


def refuse_unread(name: str, section: BaseModel, selector: str, table: dict, keys) -> None:
    """Refuse the first of `keys` set away from its default that the section's chosen
    `selector` value does not read (`table`: value -> the keys it reads)."""
    chosen = getattr(section, selector)
    unread = [k for k in changed_keys(section, keys) if k not in table[chosen]]
    if unread:
        readers = [m for m, read in table.items() if unread[0] in read]
        raise ValueError(f"{name}.{unread[0]} is not read by {name}.{selector}={chosen!r}; it is a "
                         f"setting of {', '.join(repr(m) for m in readers)}: set {name}.{selector} "
                         "to one of them or leave the key at its default")


class EngineTimeline:
    """The timeline hooks of a replica engine that records its own spans (`model.timeline`):
    mixed into its component (ZeRO, the low-communication replicas)."""

    @classmethod
    def start_timeline(cls, built: Built, timeline) -> bool:
        return start_engine_timeline(built, timeline)

    @classmethod
    def write_timeline(cls, built: Built, timeline, run_dir, step: int, mesh) -> dict:
        return write_engine_timeline(built, timeline, run_dir, step, mesh)

