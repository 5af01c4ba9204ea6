"""Activation recomputation outside the pipeline (`parallel.recompute` with pp = 1; the pipeline
recomputes per micro-batch itself, parallel/pipeline/runtime.py): "full" keeps only each
block's input and runs the block's forward again in its backward, "selective" recomputes the
attention core only (Korthikanti et al., arXiv 2205.05198). Details: docs/training.md,
"Activation recomputation".
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from loomtrain.component import CONTEXT, Built, Component, Refusal, Section, Switch


def checkpoint_blocks(model: torch.nn.Module) -> int:
    """Make every block (an element of the model's outermost ModuleLists, as ZeRO's units)
    recompute its forward in backward; returns their number. The block's own forward is
    wrapped, not its call: module hooks (ZeRO-3's gathers) run once in forward, and the
    recomputation runs inside the block's backward, after ZeRO-3 gathered it for that."""
    from loomtrain.parallel.zero import find_units

    blocks = [module for _, module in find_units(model)]
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    return len(blocks)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation, decoding: nothing to save
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def recompute_cores(model: torch.nn.Module) -> int:
    """Selective recomputation: every attention module (the GPT's, the llama's) drops its
    core's saved tensors after forward; returns their number."""
    modules = [m for m in model.modules() if hasattr(m, "recompute_core")]
    for m in modules:
        m.recompute_core = True
    return len(modules)


class RecomputeKeys(Section):
    recompute: Literal["none", "full", "selective"] = "none"


_NOT_YET = "activation recomputation runs with data, tensor and context parallelism and ZeRO today"


class Recompute(Component):
    """Activations recomputed in backward: every block, or the attention core."""

    name = "recompute"
    section, keys = "parallel", RecomputeKeys
    switches = (Switch("parallel.recompute", "none"),)
    summary = "activations recomputed in backward: every block (full) or the attention core"
    stage = CONTEXT + 5  # on the split model, before the replica engines wrap it
    refuses = {
        "asyncsgd": Refusal(_NOT_YET),
        "zeroth": Refusal("a zeroth-order step runs forwards only: nothing is saved for a "
                          "backward", yet=False),
    }

    @classmethod
    def validate(cls, cfg) -> None:
        p, m = cfg.parallel, cfg.model
        if p.recompute == "selective" and m.name == "mlp":
            raise ValueError('parallel.recompute="selective" recomputes the attention core; '
                             f'model.name={m.name!r} has none: use "full"')
        if p.recompute != "none" and p.cp > 1 and p.cp_method == "auto" and p.pp == 1:
            raise ValueError('parallel.cp_method="auto" checkpoints blocks itself, by '
                             "parallel.activation_budget_mb: leave parallel.recompute at "
                             f"\"none\" (got {p.recompute!r})")

    @classmethod
    def applies(cls, cfg) -> bool:
        """Outside the pipeline only: a pipeline recomputes per micro-batch itself."""
        return cls.active(cfg) and cfg.parallel.pp == 1

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.errors import ConfigError

        model = getattr(built.model, "module", built.model)
        full = built.cfg.parallel.recompute == "full"
        if not (checkpoint_blocks(model) if full else recompute_cores(model)):
            what = "blocks (a ModuleList's elements)" if full else "attention modules"
            raise ConfigError(f"parallel.recompute={built.cfg.parallel.recompute!r}: the model "
                              f"has no {what} to recompute")

    @classmethod
    def estimate(cls, plan) -> None:
        """The activations of one micro-batch with every block recomputed (`full`) or its
        attention core (`selective`): `recomputed_activation_bytes`. The collectives the
        recomputation repeats are counted by the components that send them."""
        p = plan.cfg.parallel
        plan.activation_bytes = recomputed_activation_bytes(
            plan.local_model, plan.cfg.train.micro_batch, plan.compute_bytes, p.recompute, p.tp,
            p.sequence_parallel)


def recomputed_activation_bytes(m, micro_batch: int, c: int, recompute: str, tp: int = 1,
                                sequence_parallel: bool = False, offloaded: int = 0) -> int:
    """One micro-batch's activation peak outside a pipeline, on one of `tp` ranks (the
    layers' bytes: pipeline/estimate.py `layer_activation_bytes`), with the first `offloaded`
    blocks' saved tensors in host memory (parallel/offload.py, each copy done where it starts).
    What a block keeps from its forward to its backward, a: all its bytes B ("none"), B less
    its attention core ("selective"), only its input X = c b t d ("full": t / tp tokens under
    sequence parallelism), which its rerun tops up by r = B - X while its backward runs. The
    forward ends holding the embedding's, the L - n kept blocks' and the head's; the backward
    of a block holds the embedding's, a + r, the kept blocks' below it and, below an offloaded
    block (or the first kept one), the block reloaded ahead: the larger of the two."""
    from loomtrain.parallel.pipeline.estimate import core_bytes, layer_activation_bytes

    def layer(kind):
        return layer_activation_bytes(m, kind, micro_batch, c, tp, sequence_parallel)

    # the largest block (a mixture of experts' when some are dense): exact when they are alike
    embed, head = layer("embed"), layer("head")
    block = max(layer(f"blocks.{i}") for i in range(m.n_layers))
    x = c * micro_batch * m.seq_len * m.d_model // (tp if sequence_parallel else 1)
    kept = {"full": x, "selective": block - core_bytes(m, micro_batch, c, tp)}.get(recompute, block)
    rerun = block - x if recompute == "full" else 0
    L, n = m.n_layers, offloaded
    held = max(1, L - n, 2 if n and L > 1 else 1)  # blocks' bytes while one runs backward
    return embed + max((L - n) * kept + head, held * kept + rerun)
