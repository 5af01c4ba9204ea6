"""The sparse-training component's keys and rules (docs/sparsity.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomtrain.component import FINISH, Built, Component, Refusal, Section, Switch, refuse_unread

# the [sparsity] keys each method reads (besides method and the SAM keys sam, rho, zo_eps,
# and sparse_comm); a key set away from its default for a method that does not read it is
# refused (it would be silently ignored)
SPARSITY_KEYS = {
    "none": (),
    "static": ("density", "distribution"),
    "nm": ("n", "m"),
    "prune": ("density", "distribution", "schedule", "start_step", "end_step", "update_every"),
    "set": ("density", "distribution", "schedule", "end_step", "update_every", "alpha"),
    "rigl": ("density", "distribution", "schedule", "end_step", "update_every", "alpha"),
}
# the schedules each method can follow, its default first
SPARSITY_SCHEDULES = {"prune": ("cubic",), "set": ("cosine", "constant"),
                      "rigl": ("cosine", "constant")}


class SparsityConfig(Section):
    # sparse training (sparsity/, docs/sparsity.md): masks on every untied nn.Linear weight
    method: Literal["none", "static", "nm", "prune", "set", "rigl"] = "none"
    density: float = Field(0.5, gt=0.0, lt=1.0)  # the kept fraction of the sparse layers' weights
    # per-layer densities: "erk" (Erdos-Renyi-Kernel: small layers denser) or "uniform"
    distribution: Literal["erk", "uniform"] = "erk"
    n: int = Field(2, ge=1)  # N:M: keep n of every m consecutive input weights of a row
    m: int = Field(4, ge=2)
    # prune: "cubic" (Zhu & Gupta); set, rigl: the swapped fraction, "cosine" (RigL's decay
    # from alpha) or "constant" (alpha, SET's paper); None: the method's first
    schedule: Literal["cubic", "cosine", "constant"] | None = None
    start_step: int = Field(0, ge=0)  # prune: the schedule's first step (dense until then)
    end_step: int | None = Field(None, ge=1)  # None: 75% of train.steps
    update_every: int = Field(100, ge=1)  # steps between mask updates
    alpha: float = Field(0.3, gt=0.0, le=1.0)  # set, rigl: the swapped fraction at step 0
    # sharpness-aware gradients: "sam" (two backwards per step) or "zo-sam" (a zeroth-order
    # ascent direction from two forwards, one backward); any method, "none" included
    sam: Literal["none", "sam", "zo-sam"] = "none"
    rho: float = Field(0.05, gt=0.0)  # the perturbation's radius
    zo_eps: float = Field(1e-3, gt=0.0)  # zo-sam: the SPSA probe's step
    # only the kept gradient entries are reduced (the sparse-aware data-parallel engine, or
    # the sharded engine's reduce-scatter of the packed kept entries)
    sparse_comm: bool = False


_APART = ("the replicas step apart between syncs, so each would update its masks from its own "
          "weights and gradient and the masks would diverge")


class Sparsity(Component):
    """[sparsity]: the keys each method reads, a schedule that fits in training, N:M groups
    that divide the layers' inputs; it runs on whole replicas and on models split by tp, pp
    and cp (each mask decision the whole layer's: sparsity/split.py; ZO-SAM's z the whole
    model's, cut), and in the sharded engine, ZeRO-1 to 3 and bf16 (sparsity/sharded.py;
    sparse_comm there: parallel/zero/sparse.py)."""

    name = "sparsity"
    section, keys = "sparsity", SparsityConfig
    switches = (Switch("sparsity.method", "none"), Switch("sparsity.sam", "none"))
    summary = "masks, N:M, pruning, SET, RigL, SAM and ZO-SAM"
    refuses = {"lowcomm": Refusal(_APART),
               "compression": Refusal("RigL regrows by the exact all-reduced gradient, and "
                                      "sparse_comm replaces the same bucket all-reduce that "
                                      "compression replaces"),
               "asyncsgd": Refusal("the parameter server's workers compute gradients alone, on "
                                   "stale weights: there is no step at which every rank holds "
                                   "the same weights to decide the masks from"),
               "balance": Refusal("not checked against the single-process run yet: the hybrid "
                                  "runtime deals each rank its own share of the step's tokens "
                                  "(plain context parallelism runs)")}
    stage = FINISH  # masks the built model's weights at once (sparsity/training.py)

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.sparsity.training import SparseTraining

        built.parts[cls.name] = SparseTraining(built.model, built.optimizer, built.cfg, built.mesh)

    @classmethod
    def before_step(cls, built: Built, step: int) -> None:
        built.parts[cls.name].before_step(step)

    @classmethod
    def gradient(cls, built: Built, forward_backward, forward_loss):
        """Its passes (SAM's two, ZO-SAM's probes) make the gradient, which it masks."""
        return built.parts[cls.name].gradient(forward_backward, forward_loss)

    @classmethod
    def after_update(cls, built: Built, stepped: bool) -> None:
        built.parts[cls.name].after_step(stepped)  # the masks re-applied (and updated)

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        return built.parts[cls.name].metrics(per_layer=evaluated)

    @classmethod
    def state(cls, built: Built, rank: int) -> dict:
        return built.parts[cls.name].state_dict()

    @classmethod
    def placeholders(cls, built: Built, path, saved: dict, rank: int) -> dict:
        return built.parts[cls.name].placeholders(path)

    @classmethod
    def load_state(cls, built: Built, state: dict, rank: int) -> None:
        built.parts[cls.name].load_state_dict(state)

    @classmethod
    def validate(cls, cfg) -> None:
        s = cfg.sparsity
        refuse_unread("sparsity", s, "method", SPARSITY_KEYS,
                       [k for k in SparsityConfig.model_fields
                        if k not in ("method", "sam", "rho", "zo_eps", "sparse_comm")])
        default = {k: SparsityConfig.model_fields[k].default for k in ("rho", "zo_eps")}
        if s.sam == "none" and (s.rho != default["rho"] or s.zo_eps != default["zo_eps"]):
            key = "rho" if s.rho != default["rho"] else "zo_eps"
            raise ValueError(f'sparsity.{key} is a setting of sharpness-aware training, which is off '
                             '(sparsity.sam="none"): set sparsity.sam to "sam" or "zo-sam" or leave it unset')
        if s.sam == "sam" and s.zo_eps != default["zo_eps"]:
            raise ValueError('sparsity.zo_eps is the probe step of sparsity.sam="zo-sam"; "sam" takes '
                             "its ascent direction from a backward pass: leave it unset")
        if s.method in SPARSITY_SCHEDULES and s.schedule not in (None, *SPARSITY_SCHEDULES[s.method]):
            raise ValueError(f"sparsity.schedule={s.schedule!r} is not a schedule of sparsity.method="
                             f"{s.method!r}; it follows "
                             f"{' or '.join(repr(x) for x in SPARSITY_SCHEDULES[s.method])}")
        steps = cfg.train.steps
        end = s.end_step if s.end_step is not None else max(1, round(0.75 * steps))
        if s.end_step is not None and s.end_step > steps:
            raise ValueError(f"sparsity.end_step={s.end_step} is after the last step, train.steps={steps}")
        if s.method == "prune" and end <= s.start_step:
            raise ValueError(f"sparsity.start_step={s.start_step} must be before sparsity.end_step="
                             f"{end}{'' if s.end_step is not None else ' (75% of train.steps)'}: the "
                             "cubic schedule prunes from dense at start_step to sparsity.density at end_step")
        if s.method == "nm":
            _check_nm(s, cfg)
        if s.sparse_comm and s.method == "none":
            raise ValueError("sparsity.sparse_comm=true all-reduces only the kept gradient entries; "
                             'sparsity.method="none" keeps them all: choose a sparsity method')


def _check_nm(s: SparsityConfig, cfg) -> None:
    """N:M groups run along each masked nn.Linear's inputs (masks.nm_mask), so m must divide
    every such width: read off the model built on the meta device, which knows them all
    (d_model, the GPT's mlp_ratio x d_model, the llama's ffn_hidden, the digits' 64 pixels)."""
    from loomtrain.sparsity.sparsifier import whole_layers
    from loomtrain.train.task import is_classification

    if s.n >= s.m:
        raise ValueError(f"sparsity.n={s.n} must be less than sparsity.m={s.m} (N:M keeps n of "
                         "every m weights; 2:4 is the one sparse tensor cores run)")
    if is_classification(cfg) and cfg.model.name != "mlp":
        return  # no model to build: the [data] rules refuse the pairing, with their reason
    for name, shape in whole_layers(cfg):
        width = shape[1]
        if width % s.m:
            what = (f"model.d_model = {width}" if width == cfg.model.d_model
                    else f"the {width} inputs of {name}")
            raise ValueError(f"sparsity.m={s.m} must divide {what}: N:M groups m "
                             "consecutive inputs of each nn.Linear row")
