"""The compression component's keys and rules (docs/compression.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomtrain.component import (PREPARE, Built, Component, Refusal, Section, Switch, changed_keys,
                                 refuse_unread)

# the [compression] keys each method reads (besides method, error_feedback and applies_to)
COMPRESSION_KEYS = {"none": (), "topk": ("ratio",), "randomk": ("ratio",), "powersgd": ("rank",),
                    "int8": (), "sign": ()}


class CompressionConfig(Section):
    # gradient compression (comm/compress/, docs/compression.md): what each rank sends of a
    # gradient bucket (applies_to="gradients", the data-parallel engine) or of DiLoCo's
    # pseudo-gradient (applies_to="pseudo_gradients")
    method: Literal["none", "topk", "randomk", "powersgd", "int8", "sign"] = "none"
    ratio: float = Field(0.01, gt=0.0, le=1.0)  # top-k, random-k: the fraction of values sent
    rank: int = Field(4, ge=1)  # PowerSGD's rank r
    # keep what compression dropped and add it to the next bucket; None: the method's default
    # (on for topk, randomk, powersgd and sign; off for int8)
    error_feedback: bool | None = None
    applies_to: Literal["gradients", "pseudo_gradients"] = "gradients"
    # every N optimizer steps, measure the error of the compressed sum against the dense sum
    # (a dense all-reduce off the simulated link, counted apart as "all_reduce_diagnostic");
    # 0: never
    error_every: int = Field(0, ge=0)


def _on_gradients(cfg) -> bool:
    return cfg.compression.applies_to == "gradients"


_PLAIN_ENGINE = ("it runs in the plain data-parallel engine (fp32, ZeRO stage 0), and the "
                 "sharded engine's reduce-scatter is not compressed")


class Compression(Component):
    """Compression runs in the plain data-parallel engine (fp32, no ZeRO, no low-communication
    wrapper) for gradients, and in DiLoCo's outer all-reduce for pseudo-gradients."""

    name = "compression"
    section, keys = "compression", CompressionConfig
    switches = (Switch("compression.method", "none"),)
    summary = "top-k, random-k, PowerSGD, int8 or sign, with error feedback"
    refuses = {
        "lowcomm": Refusal("on gradients it needs the data-parallel engine, and the "
                           "low-communication replicas' engine reduces no gradients; "
                           'compression.applies_to="pseudo_gradients" compresses DiLoCo\'s '
                           "outer all-reduce", when=_on_gradients, partly="on gradients"),
        "zero": Refusal(_PLAIN_ENGINE, when=_on_gradients, partly="on gradients"),
        "bf16": Refusal(_PLAIN_ENGINE, when=_on_gradients, partly="on gradients"),
    }

    stage = PREPARE

    @classmethod
    def apply(cls, built: Built) -> None:
        """The compressor the replica engine sends through. Error feedback defaults to on,
        except for int8 (its error is small)."""
        from loomtrain.comm.compress import build_compressor

        c, cfg = built.cfg.compression, built.cfg
        error_feedback = c.error_feedback if c.error_feedback is not None else c.method != "int8"
        built.compressor = build_compressor(c.method, c.ratio, c.rank, error_feedback,
                                            cfg.run.seed, scheme=cfg.comm.sparse_allreduce)

    @classmethod
    def estimate(cls, plan) -> None:
        """DiLoCo's compressed outer all-reduce is not modelled yet (on gradients the dry run
        reports the dense buckets)."""
        from loomtrain.errors import ConfigError

        if plan.cfg.compression.applies_to == "pseudo_gradients":
            raise ConfigError("loom train --dry-run does not model compressed pseudo-gradients "
                              'yet (compression.applies_to="pseudo_gradients"): run without '
                              "--dry-run, or with compression.method=\"none\"")

    @classmethod
    def before_step(cls, built: Built, step: int) -> None:
        """Every error_every steps: this step's compressed sum measured against the dense."""
        every = built.cfg.compression.error_every
        if every and (step + 1) % every == 0 and hasattr(built.model, "measure_error"):
            built.model.measure_error()

    # a rank's compressor state (error-feedback residuals, PowerSGD's factors, random-k's
    # counters) differs per rank: the keys name the rank, and the method, so that a resume with
    # another method starts its own state afresh
    @classmethod
    def _prefix(cls, built: Built, rank: int) -> str:
        return f"compression.{built.compressor.name}.rank{rank}."

    @classmethod
    def state(cls, built: Built, rank: int) -> dict:
        prefix = cls._prefix(built, rank)
        return {prefix + k: v for k, v in built.compressor.state_dict().items()}

    @classmethod
    def placeholders(cls, built: Built, path, saved: dict, rank: int) -> dict:
        import torch

        prefix = cls._prefix(built, rank)
        return {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in saved.items()
                if k.startswith(prefix)}

    @classmethod
    def load_state(cls, built: Built, state: dict, rank: int) -> None:
        prefix = cls._prefix(built, rank)
        mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not mine:
            return  # none saved (another method, or none): the run starts its state afresh
        _check_state(built.model, built.compressor, mine)
        built.compressor.load_state_dict(mine)

    @classmethod
    def validate(cls, cfg) -> None:
        c = cfg.compression
        refuse_unread("compression", c, "method", COMPRESSION_KEYS, ("ratio", "rank"))
        if c.method == "none":
            others = changed_keys(c, ("error_feedback", "applies_to", "error_every"))
            if others:
                raise ValueError(f"compression.{others[0]} is set but compression.method=\"none\": "
                                 "choose a method (topk, randomk, powersgd, int8, sign) or leave "
                                 "it unset")
            return
        if c.applies_to == "pseudo_gradients" and cfg.lowcomm.algorithm != "diloco":
            raise ValueError(
                'compression.applies_to="pseudo_gradients" compresses DiLoCo\'s outer all-reduce; '
                f"lowcomm.algorithm={cfg.lowcomm.algorithm!r} has none to compress: set "
                'lowcomm.algorithm="diloco", or applies_to="gradients" without lowcomm')


def _check_state(model, compressor, state: dict) -> None:
    """Error-feedback residuals fit the engine's gradient buckets, and PowerSGD's warm-start
    Q their layout at this run's rank (ValueError if not), before anything is resumed."""
    from loomtrain.comm.compress.powersgd import PowerSGD, plan_layout

    buckets = getattr(model, "buckets", None)
    if buckets is None:
        return
    for name, tensor in state.items():
        slot, _, key = name.partition("/")
        if slot in ("residual", "q") and (not key.isdigit() or int(key) >= len(buckets)):
            raise ValueError(
                f"its compression state {name!r} names a gradient bucket this run does not have "
                f"({len(buckets)} buckets): the buckets changed (parallel.bucket_mb, the model or "
                "tp/pp differ from the checkpoint's config.toml); resume with those settings")
        if slot == "residual" and buckets[int(key)].buffer.numel() != tensor.numel():
            raise ValueError(
                f"its compression residual {key!r} ({tensor.numel()} values) does not fit this "
                f"run's {len(buckets)} gradient buckets: the buckets changed (parallel.bucket_mb, "
                "the model or tp/pp differ from the checkpoint's config.toml); resume with those "
                "settings")
        if slot == "q" and isinstance(compressor, PowerSGD):
            shapes = [p.shape for p in buckets[int(key)].params]
            need = plan_layout(shapes, compressor.rank).q_numel
            if need != tensor.numel():
                raise ValueError(
                    f"its PowerSGD warm-start Q of gradient bucket {key} holds {tensor.numel()} "
                    f"values where this run's compression.rank={compressor.rank} needs {need}: "
                    "compression.rank or the buckets (parallel.bucket_mb, the model, tp/pp) "
                    "differ from the checkpoint's config.toml, or it was saved before PowerSGD "
                    "factored stacked experts one by one (2026-12-07); resume with the "
                    "checkpoint's settings")
