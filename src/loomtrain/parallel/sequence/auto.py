"""Automatic sequence parallelism: an unmodified model made sequence-parallel by rewriting its
traced graph, with activation checkpointing chosen for the context length (the AutoSP idea,
arXiv 2604.27089). Nothing in the user's model class is edited or patched.

`find_attention`, `plan_sequence`, `auto_sequence`; the rules and the refusals:
docs/sequence-auto.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from loomtrain.parallel.sequence.auto_trace import (SDPA_ARGS, AttentionReport, find_attention,
                                                    node_named, owned_bytes, run_meta,
                                                    sdpa_arguments, tensor_bytes)
from loomtrain.parallel.sequence.runtime import LAYOUT, SequenceRuntime


def choose_method(heads: list[int], cp: int) -> str:
    """Ulysses when every attention call's heads divide by cp, else ring attention."""
    return "ulysses" if all(h % cp == 0 for h in heads) else "ring"


def plan_checkpointing(top_bytes: int, block_bytes: list[int], boundary_bytes: list[int],
                       budget_bytes: int | None) -> tuple[int, int, bool]:
    """(estimate, estimate with every block checkpointed, checkpoint?). Checkpointed, a block
    keeps its input and one block's intermediates live at a time, during its recompute."""
    plain = top_bytes + sum(block_bytes)
    kept = top_bytes + sum(boundary_bytes) + max(block_bytes, default=0)
    return plain, kept, budget_bytes is not None and plain > budget_bytes


@dataclass(frozen=True)
class SequencePlan:
    method: str  # "ulysses" or "ring"
    layout: str  # "contiguous" or "zigzag"
    cp: int
    local_len: int  # tokens per rank
    heads: tuple[int, ...]  # of every attention call, in graph order
    estimate_bytes: int  # activation estimate per rank, per micro-batch, without checkpointing
    checkpointed_bytes: int  # the same with every block checkpointed
    budget_bytes: int | None
    checkpointed: bool

    def describe(self) -> str:
        return (f"{self.method} ({self.layout}) over cp={self.cp}, {self.local_len} tokens per "
                f"rank; activations ~{self.estimate_bytes / 2**20:.2f} MiB, budget "
                + ("none" if self.budget_bytes is None else f"{self.budget_bytes / 2**20:.2f} MiB")
                + (f"; blocks checkpointed: ~{self.checkpointed_bytes / 2**20:.2f} MiB"
                   if self.checkpointed else ""))


def plan_sequence(report: AttentionReport, cp: int, sample_len: int,
                  budget_bytes: int | None = None, micro_batch: int = 1) -> SequencePlan:
    """The kernel, layout and checkpointing for rows of `sample_len` tokens over `cp` ranks,
    from the report's graphs run on meta token ids (micro_batch, sample_len / cp)."""
    report.check()
    if sample_len % (2 * cp):
        raise ValueError(f"a row of {sample_len} tokens does not split into 2 x cp = {2 * cp} "
                         "equal chunks (the zig-zag layout; the contiguous one needs cp)")
    local_len = sample_len // cp
    run_meta(report, micro_batch, local_len)
    graphs = report.graphs()
    heads = []
    for site in report.attention:
        given = sdpa_arguments(node_named(graphs[site.graph], site.node))
        q, k, v = (given[name].meta["val"] for name in SDPA_ARGS[:3])
        if not q.shape == k.shape == v.shape:
            raise ValueError(f"automatic sequence parallelism: {site.path}: q, k and v differ in "
                             "shape (grouped-query attention?), which the kernels do not take")
        heads.append(q.shape[1])
    for site in report.positions:
        shape = tuple(node_named(graphs[site.graph], site.node).meta["val"].shape)
        if shape != (local_len,):
            raise ValueError(f"automatic sequence parallelism: {site.path}: torch.arange of "
                             f"shape {shape} is not one position per token ({local_len},)")
    calls = report.block_calls()
    plain, kept, checkpointed = plan_checkpointing(
        owned_bytes(report.top, skip=report.blocks),
        [owned_bytes(report.blocks[n.target]) for n in calls],
        [tensor_bytes(n.meta["val"]) for n in calls], budget_bytes)
    method = choose_method(heads, cp)
    return SequencePlan(method, LAYOUT[method], cp, local_len, tuple(heads), plain, kept,
                        budget_bytes, checkpointed)


class SequenceAttention(nn.Module):
    """What every SDPA call becomes: the plan's kernel over the batch's SeqContext (read at
    call time, so a checkpointed block's recompute in backward sees the same batch)."""

    def __init__(self, runtime: SequenceRuntime):
        super().__init__()
        self.runtime = runtime

    def forward(self, q, k, v):
        from loomtrain.parallel.sequence.ring import ring_attention
        from loomtrain.parallel.sequence.ulysses import ulysses_attention

        ctx = self.runtime.context
        assert ctx is not None, "model.sequence.shard must run before the forward"
        kernel = ring_attention if self.runtime.method == "ring" else ulysses_attention
        return kernel(q, k, v, ctx)


class SequencePositions(nn.Module):
    """What a positions arange becomes: `start` plus this rank's global positions (the arange
    over the local tokens would count them 0..t_local-1 on every rank)."""

    def __init__(self, runtime: SequenceRuntime):
        super().__init__()
        self.runtime = runtime

    def forward(self, *args, dtype=None, device=None, **kwargs):
        named = dict(zip(("start", "end", "step") if len(args) > 1 else ("end",), args), **kwargs)
        start, end, step = named.get("start", 0), named["end"], named.get("step", 1)
        ctx = self.runtime.context
        assert ctx is not None, "model.sequence.shard must run before the forward"
        positions = ctx.local_positions
        assert step == 1 and end - start == len(positions), "arange is not one position per token"
        return (start + positions).to(device=device, dtype=dtype or positions.dtype)


def _replace(gm: fx.GraphModule, node: fx.Node, op: str, target, args, kwargs) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.create_node(op, target, tuple(args), kwargs)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _carry_state(model: nn.Module, gm: fx.GraphModule) -> None:
    """Parameters and buffers the traced forward never touches keep their place, so that the
    rewritten model's state_dict keys are the model's (checkpoints stay interchangeable)."""
    have = gm.state_dict(keep_vars=True)
    for key, value in model.state_dict(keep_vars=True).items():
        if key in have:
            continue
        path, _, name = key.rpartition(".")
        owner = gm
        for part in filter(None, path.split(".")):
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, nn.Parameter):
            owner.register_parameter(name, value)
        else:
            owner.register_buffer(name, value)


def _keep_module_lists(model: nn.Module, gm: fx.GraphModule) -> None:
    """The traced model holds its repeated blocks in nn.ModuleLists again, as the model did
    (fx rebuilds the containers as plain modules): ZeRO's units and activation offload find a
    model's blocks as the children of its ModuleLists (zero `find_units`)."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not name:
            continue
        parent, _, leaf = name.rpartition(".")
        try:
            owner, kept = gm.get_submodule(parent), gm.get_submodule(name)
        except AttributeError:  # a list the traced forward never reaches
            continue
        children = dict(kept.named_children())
        if isinstance(kept, nn.ModuleList) or set(children) != set(map(str, range(len(children)))):
            continue  # already one, or not every block is traced: the names must stay
        owner._modules[leaf] = nn.ModuleList(children[str(i)] for i in range(len(children)))


ATTENTION, POSITIONS = "auto_sequence_attention", "auto_sequence_positions"


def auto_sequence(model: nn.Module, mesh, sample_len: int, budget_bytes: int | None = None,
                  micro_batch: int = 1) -> fx.GraphModule:
    """`model` rewritten for the mesh's cp axis (docs/sequence-auto.md). The result shares
    the model's parameters (same state_dict keys) and takes this rank's tokens: call
    `result.sequence.shard(x, y, docs)` on the full rows first, as the trainer does; the
    decision is `result.plan`. `budget_bytes`: per-rank activation memory for one micro-batch
    of `micro_batch` rows (None: never checkpoint)."""
    report = find_attention(model)
    plan = plan_sequence(report, mesh.size("cp"), sample_len, budget_bytes, micro_batch)
    gm = report.top
    for path, block in report.blocks.items():
        gm.add_submodule(path, block)
    _keep_module_lists(model, gm)
    runtime = SequenceRuntime(gm, mesh, plan.method, "softmax")
    runtime.plan = plan
    attention, positions = SequenceAttention(runtime), SequencePositions(runtime)
    for prefix, graph_module in report.graphs().items():
        for name in (ATTENTION, POSITIONS):
            assert not hasattr(graph_module, name), f"{prefix or 'the model'} has a {name}"
        graph_module.add_module(ATTENTION, attention)
        graph_module.add_module(POSITIONS, positions)
    graphs = report.graphs()
    for site in report.attention:  # SDPA(q, k, v, causal) -> the kernel
        node = node_named(graphs[site.graph], site.node)
        given = sdpa_arguments(node)
        _replace(graphs[site.graph], node, "call_module", ATTENTION,
                 [given[name] for name in SDPA_ARGS[:3]], {})
    for site in report.positions:  # torch.arange(...) -> the global positions, same arguments
        node = node_named(graphs[site.graph], site.node)
        _replace(graphs[site.graph], node, "call_module", POSITIONS, node.args, dict(node.kwargs))
    if plan.checkpointed:  # block(x) -> checkpoint(block, x, use_reentrant=False)
        for node in report.block_calls():
            with gm.graph.inserting_before(node):
                block = gm.graph.get_attr(node.target)
            _replace(gm, node, "call_function", checkpoint, (block, *node.args),
                     {**node.kwargs, "use_reentrant": False})
    for graph_module in report.graphs().values():
        graph_module.graph.lint()
        graph_module.recompile()
    _carry_state(model, gm)
    gm.sequence, gm.plan = runtime, plan
    return gm


__all__ = ["SequencePlan", "auto_sequence", "choose_method", "find_attention",
           "plan_checkpointing", "plan_sequence"]
