"""Activation offload outside the pipeline (`parallel.offload_activations` with pp = 1; a
pipeline offloads whole (micro-batch, stage) pairs itself, parallel/pipeline/runtime.py): of
the model's L blocks (ZeRO's units, as recomputation's), the first round(f L), whose saved
activations wait longest between their forward and their backward, hand what autograd saves
to the pipeline's ActivationStash (pinned host buffers and a side stream on CUDA). Each
block's are copied to host memory right after its forward, and come back when the backward
reaches the block after it: one block ahead. Details: docs/training.md, "Activation offload".
"""

from __future__ import annotations

import functools

import torch

from loomtrain.component import CONTEXT, Built, Component, Refusal, Switch
from loomtrain.parallel.pipeline.offload import ActivationStash


def offloaded_blocks(blocks: int, fraction: float) -> int:
    """How many of the first blocks offload: round(fraction x blocks), as the pipeline rounds
    its share of pairs (schedules.with_offload)."""
    return round(fraction * blocks)


class BlockOffload:
    """The first `count` blocks of a model offload their saved activations through `stash`
    (`stash.synchronous = True`: each copy ends where it starts, as tests measure it). A block
    offloads only while its inputs need a gradient: their gradient, at the end of the block's
    backward, releases its pair."""

    def __init__(self, model: torch.nn.Module, fraction: float, device: torch.device):
        from loomtrain.parallel.zero import find_units

        blocks = [module for _, module in find_units(model)]
        self.count = offloaded_blocks(len(blocks), fraction)
        self.stash = ActivationStash(model.parameters(), device)
        # each block's last offloaded pair, linked to the next block's pair of its micro-batch
        self._latest: dict[int, list] = {}
        self._forwards = 0
        # block `count` is kept, but its backward starts the reload of the last offloaded one
        for k, block in enumerate(blocks[:self.count + 1]):
            block.forward = functools.partial(self._forward, k, block.forward)

    def _forward(self, k: int, forward, *args, **kwargs):
        inputs = [t for t in (*args, *kwargs.values())
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not torch.is_grad_enabled() or not inputs:  # evaluation, decoding
            return forward(*args, **kwargs)
        before = self._latest.get(k - 1)  # [its key, ours]: block k - 1 ran just before
        if k == self.count:
            out = forward(*args, **kwargs)
            self._when_reached(out, [None, None], before)
            return out
        key, self._forwards = (self._forwards, k), self._forwards + 1
        with self.stash.saving(key):
            out = forward(*args, **kwargs)
        self.stash.offload(key)
        if before is not None:
            before[1] = key
        link = self._latest[k] = [key, None]
        torch.autograd.graph.register_multi_grad_hook(
            inputs, lambda grads: self.stash.release(key))
        self._when_reached(out, link, before)
        return out

    def _when_reached(self, out: torch.Tensor, link: list, before: list | None) -> None:
        """When the backward reaches the block that made `out` (its output's gradient): the
        next block's pair (link[1]), whose backward this gradient ends, is released first (its
        input's hook would release it too, maybe after the reloads), then the block's own pair
        (link[0]) and the block before's (the next to go back through) are reloaded. The
        links are made in forward, per micro-batch: two graphs alive at once stay apart."""
        def reached(grad):
            if link[1] is not None:
                self.stash.release(link[1])
            for key in (link[0], before and before[0]):
                if key is not None:
                    self.stash.reload(key)
        if out.requires_grad:
            out.register_hook(reached)


class ActivationOffload(Component):
    """`parallel.offload_activations` at pp = 1 (the key is the pipeline's, which offloads per
    micro-batch and stage itself)."""

    name = "offload"
    switches = (Switch("parallel.offload_activations", 0.0),)
    summary = "the saved activations of the first blocks wait in host memory"
    # after recomputation, so outside its checkpoint: the stash gets what the checkpoint
    # saves (the block's input), and the rerun in backward saves nothing through it; after
    # compilation, so outside the compiled forward, whose saved tensors it stashes
    stage = CONTEXT + 7
    refuses = {
        "asyncsgd": Refusal("activation offload runs with data, tensor and context parallelism "
                            "and ZeRO today"),
        "zeroth": Refusal("a zeroth-order step runs forwards only: nothing is saved for a "
                          "backward", yet=False),
    }

    @classmethod
    def applies(cls, cfg) -> bool:
        return cls.active(cfg) and cfg.parallel.pp == 1

    @classmethod
    def validate(cls, cfg) -> None:
        p, blocks = cfg.parallel, cfg.model.n_layers
        if p.pp == 1 and p.offload_activations and not offloaded_blocks(blocks, p.offload_activations):
            raise ValueError(f"parallel.offload_activations={p.offload_activations} offloads "
                             f"round(f x blocks) = 0 of the model's {blocks} blocks at "
                             f"parallel.pp=1: raise it above {0.5 / blocks:.3g}, or set 0")

    @classmethod
    def apply(cls, built: Built) -> None:
        model = getattr(built.model, "module", built.model)
        built.parts[cls.name] = BlockOffload(model, built.cfg.parallel.offload_activations,
                                             built.mesh.device)

    @classmethod
    def estimate(cls, plan) -> None:
        """The activation peak with the first blocks offloaded (recompute.py
        `recomputed_activation_bytes`, with or without recomputation); its record: how many."""
        from loomtrain.parallel.recompute import recomputed_activation_bytes

        p, m = plan.cfg.parallel, plan.local_model
        n = plan.parts[cls.name] = offloaded_blocks(m.n_layers, p.offload_activations)
        plan.activation_bytes = recomputed_activation_bytes(
            m, plan.cfg.train.micro_batch, plan.compute_bytes, p.recompute, p.tp,
            p.sequence_parallel, n)
