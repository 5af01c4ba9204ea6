"""Zeroth-order training as a component (docs/zeroth.md): the [optim] section, its keys
read per method, and what a zeroth-order method does not run with."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomtrain.component import Component, Refusal, Section, Switch, changed_keys

# the zeroth-order methods of [optim] (zeroth/, docs/zeroth.md)
ZO_METHODS = ("mezo", "mezo-svrg", "helene", "zo-momentum", "zo-adam", "sparse-mezo")


class OptimConfig(Section):
    # "backprop": forward, backward and train.optimizer (the trainer); the others train from
    # forward passes alone, ranks exchanging only (seed, scalar) pairs (zeroth/train.py)
    name: Literal["backprop", "mezo", "mezo-svrg", "helene", "zo-momentum", "zo-adam",
                  "sparse-mezo"] = "backprop"
    # the rest is read by the zeroth-order methods only. lr: the peak of train's schedule
    # (warmup, cosine) in place of train.lr (None: train.lr)
    lr: float | None = Field(None, gt=0.0)
    # the parameters trained, as name prefixes ("blocks.3.") or globs ("*.bias"); the others
    # stay frozen, bitwise; empty: all
    trainable: list[str] = []
    # the methods' own keys, each read only by the methods whose `zeroth.hyper_keys` list it;
    # None: the method's default (docs/zeroth.md, "The methods")
    eps: float | None = Field(None, gt=0.0)  # the SPSA perturbation scale
    n_perturbations: int | None = Field(None, ge=1)  # probes per rank and step, averaged
    sparsity: float | None = Field(None, ge=0.0, lt=1.0)  # sparse-mezo: share not perturbed
    mask_every: int | None = Field(None, ge=1)  # sparse-mezo: steps between thresholds
    momentum: float | None = Field(None, ge=0.0, lt=1.0)  # zo-momentum
    betas: tuple[float, float] | None = None  # zo-adam, helene
    adam_eps: float | None = Field(None, gt=0.0)  # zo-adam
    svrg_every: int | None = Field(None, ge=1)  # mezo-svrg: steps between large batches
    svrg_batches: int | None = Field(None, ge=1)  # mezo-svrg: batches in a large batch
    svrg_lr_ratio: float | None = Field(None, ge=0.0)  # mezo-svrg: a refresh's lr / lr
    anneal_steps: float | None = Field(None, gt=0.0)  # helene
    hessian_every: int | None = Field(None, ge=1)  # helene
    gamma: float | None = Field(None, gt=0.0)  # helene
    hessian_clip: float | None = Field(None, ge=0.0)  # helene
    precond_eps: float | None = Field(None, gt=0.0)  # helene

    @model_validator(mode="after")
    def _keys(self) -> "OptimConfig":
        if self.betas is not None and not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas={list(self.betas)}: both must be in [0, 1)")
        if any(not pattern for pattern in self.trainable):
            raise ValueError(f"optim.trainable={self.trainable}: a pattern is empty; give name "
                             'prefixes such as "blocks.3." or globs such as "*.bias"')
        return self


# train.optimizer's keys: backprop's update rule, which a zeroth-order method replaces
_BACKPROP_KEYS = ("optimizer", "beta1", "beta2", "weight_decay", "grad_clip")
class Zeroth(Component):
    """[optim]: its zeroth-order keys only with a zeroth-order name, each read by the method
    (`zeroth.hyper_keys`); a zeroth-order method with neither backprop's keys nor the engines
    and layouts it does not run in (zeroth/train.py)."""

    name = "zeroth"
    section, keys = "optim", OptimConfig
    switches = (Switch("optim.name", "backprop"),)
    summary = "MeZO and variants from forward passes, ranks exchanging seeds and scalars"
    refuses = {
        "async_pipeline": Refusal("its runtime steps each stage's own backprop optimizer after "
                                  "every micro-batch; the probes run the synchronous pipeline's "
                                  "forward-only path", yet=False),
        "zero": Refusal("ZeRO shards gradients and optimizer state; a zeroth-order step has no "
                        "gradient, and its memory is already that of inference", yet=False),
        "bf16": Refusal("the probes run the fp32 model (bf16 with fp32 master weights is the "
                        "backprop engine's)"),
        "lowcomm": Refusal("the ranks exchange only seeds and scalars every step and stay bitwise "
                           "identical: there are no replicas to average", yet=False),
        "compression": Refusal("there is no gradient to compress: the ranks exchange 12 bytes per "
                               "probe", yet=False),
        "asyncsgd": Refusal("the parameter server applies workers' gradients, and a zeroth-order "
                            "rank computes none", yet=False),
        "straggler": Refusal("it slows the ranks of the backprop trainer, which the zeroth-order "
                             "loop is not"),
        "sparsity": Refusal("sparse training masks gradients and regrows from them (RigL), and "
                            "SAM and ZO-SAM take backprop steps at perturbed weights; sparse MeZO "
                            "(optim.name=\"sparse-mezo\") is the zeroth-order method that "
                            "perturbs only part of the weights", yet=False),
        "timeline": Refusal("the timeline is recorded by the backprop engines"),
    }

    @classmethod
    def estimate(cls, plan) -> None:
        from loomtrain.zeroth.estimate import estimate_zeroth

        estimate_zeroth(plan)

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.optim
        changed = [k for k in changed_keys(o) if k != "name"]
        if o.name == "backprop":
            if changed:
                raise ValueError(f"optim.{changed[0]} is a setting of the zeroth-order methods, but "
                                 'optim.name="backprop" (the default) trains with train.optimizer: '
                                 f"set optim.name to one of {', '.join(ZO_METHODS)} or leave the "
                                 "key unset")
            return
        from loomtrain.zeroth import hyper_keys

        unread = [k for k in changed if k not in ("lr", "trainable") and k not in hyper_keys(o.name)]
        if unread:
            readers = [m for m in ZO_METHODS if unread[0] in hyper_keys(m)]
            raise ValueError(f"optim.{unread[0]} is not read by optim.name={o.name!r}; it is a "
                             f"setting of {', '.join(repr(m) for m in readers)}: set optim.name to "
                             "one of them or leave the key unset")
        for key in _BACKPROP_KEYS:
            value, default = getattr(cfg.train, key), type(cfg.train).model_fields[key].default
            if value != default:
                raise ValueError(f"train.{key}={value!r} is a setting of backprop's optimizer; "
                                 f"optim.name={o.name!r} updates from forward passes by its own "
                                 f"rule and does not read it: leave it at its default ({default!r})")
