"""Per-block compilation (`train.compile`): every block's forward (a transformer block's, the
MLP's residual block's) goes through `torch.compile`, as TorchTitan compiles each
TransformerBlock (`apply_compile`, after tensor parallelism and activation checkpointing,
before FSDP). The blocks of a model are alike, so the graphs traced for the first serve the
rest; the embedding, the head and the loss stay eager. Where a collective, or a value read on
the host, sits inside a block, dynamo splits the block's graph there and runs that call
eagerly (a graph break): docs/compile.md lists the breaks of every layout, measured.
"""

from __future__ import annotations

import torch

from loomtrain.component import CONTEXT, Built, Component, Refusal, Switch


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile the forward of every block (an element of the model's outermost ModuleLists, as
    ZeRO's units and recomputation's); returns their number. The block's own forward is
    compiled, not its call, so the module hooks stay outside the graph and run eagerly, once
    per call: ZeRO-3's gathers before the block, its reduce-scatter after the backward, as
    FSDP's hooks stay outside TorchTitan's compiled blocks. A block wrapped for recomputation
    before (parallel/recompute.py) is compiled with its checkpoint inside the graph."""
    from loomtrain.parallel.zero import find_units

    blocks = [module for _, module in find_units(model)]
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)


class Compile(Component):
    """`train.compile` (its keys are [train]'s, train/config.py): each block's forward
    compiled; the rest of the model eager."""

    name = "compile"
    switches = (Switch("train.compile", False),)
    summary = "each transformer block's forward compiled by torch.compile"
    # after recomputation (its checkpoint is traced into the graph, as TorchTitan's), before
    # activation offload (its saved-tensor hooks stay outside) and the replica engines
    stage = CONTEXT + 6
    refuses = {
        "asyncsgd": Refusal("the parameter server's workers build their models apart from the "
                            "components, so no block would be compiled"),
        "zeroth": Refusal("a zeroth-order run builds the model with the splitting components "
                          "only (tensor, pipeline, context), so no block would be compiled"),
    }

    @classmethod
    def validate(cls, cfg) -> None:
        t = cfg.train
        if not t.compile and t.compile_backend != "inductor":
            raise ValueError(f"train.compile_backend={t.compile_backend!r} chooses how the blocks "
                             "are compiled: set train.compile=true, or leave the key at its "
                             'default ("inductor")')

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.errors import ConfigError

        model = getattr(built.model, "module", built.model)
        if not compile_blocks(model, built.cfg.train.compile_backend):
            raise ConfigError("train.compile=true: the model has no blocks (a ModuleList's "
                              "elements) to compile")

    @classmethod
    def describe(cls, built: Built) -> str | None:
        return f"each block's forward compiled (backend {built.cfg.train.compile_backend!r})"
