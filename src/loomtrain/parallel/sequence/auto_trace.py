"""How automatic sequence parallelism (auto.py) reads an unmodified model: torch.fx symbolic
tracing (the repeated blocks traced one by one), the attention calls and position aranges
found in the graphs, and shapes from a run on meta tensors. Details: docs/sequence-auto.md,
"How the model is read: torch.fx".
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

# what SDPA calls may pass (positional order) and the only values the kernels implement
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                 "enable_gqa": False}
SUPPORTED = {"attn_mask": (None, "an explicit attn_mask"), "dropout_p": (0.0, "attention dropout"),
             "is_causal": (True, "non-causal attention"), "scale": (None, "a custom scale"),
             "enable_gqa": (False, "grouped-query attention")}
SIZE_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv}


@dataclass
class Site:
    path: str  # the module that makes the call ("" the model itself)
    graph: str  # the traced graph holding it: "" the model's, else the block's path
    node: str  # the fx node's name
    problem: str | None = None


@dataclass
class AttentionReport:
    attention: list[Site]
    positions: list[Site]
    top: fx.GraphModule  # the model traced with its repeated blocks as leaves
    blocks: dict[str, fx.GraphModule] = field(default_factory=dict)  # path -> traced block

    def graphs(self) -> dict[str, fx.GraphModule]:
        return {"": self.top, **self.blocks}

    def block_calls(self) -> list[fx.Node]:
        """The model graph's calls of its traced blocks."""
        return [n for n in self.top.graph.nodes
                if n.op == "call_module" and n.target in self.blocks]

    def check(self) -> None:
        """Raise ValueError naming every unsupported call, or when there is no attention."""
        if not self.attention:
            raise ValueError("automatic sequence parallelism found no "
                             "F.scaled_dot_product_attention call in the model's traced forward")
        bad = [f"{s.path or 'the model'} ({s.node}): {s.problem}"
               for s in self.attention + self.positions if s.problem]
        if bad:
            raise ValueError("automatic sequence parallelism cannot rewrite " + "; ".join(bad))


def repeated_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """path -> module: the children of the model's outermost nn.ModuleLists."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(p + ".") for p in found):
            found.update({f"{name}.{i}": child for i, child in enumerate(module)})
    return found


class _BlockTracer(fx.Tracer):
    proxy_buffer_attributes = True  # buffers as get_attr nodes, like parameters: a position
    # table sliced by the length is then seen (and refused)

    def __init__(self, leaves: set[int]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, module: nn.Module, name: str) -> bool:
        return (id(module) in self.leaves or getattr(module, "traced_whole", False)
                or super().is_leaf_module(module, name))


def _defaults(forward, passed: int, keywords) -> dict:
    """concrete_args: the defaults of the arguments past the first `passed` positional ones
    and not in `keywords`."""
    params = list(inspect.signature(forward).parameters.values())[passed:]
    return {p.name: p.default for p in params if p.name not in keywords
            and p.default is not inspect.Parameter.empty}


def _trace(root: nn.Module, leaves: set[int], concrete: dict) -> fx.GraphModule:
    try:
        graph = _BlockTracer(leaves).trace(root, concrete_args=concrete)
    except fx.proxy.TraceError as err:  # e.g. data-dependent control flow
        raise ValueError(f"automatic sequence parallelism cannot trace "
                         f"{type(root).__name__}.forward with torch.fx: {err}") from None
    return fx.GraphModule(root, graph, class_name=type(root).__name__)


def find_attention(model: nn.Module) -> AttentionReport:
    """Trace `model` (docs/sequence-auto.md) and find its attention calls and positions."""
    blocks = repeated_blocks(model)
    top = _trace(model, {id(b) for b in blocks.values()}, _defaults(model.forward, 1, ()))
    report = AttentionReport([], [], top)
    for node in top.graph.nodes:
        if node.op == "call_module" and node.target in blocks and node.target not in report.blocks:
            block = blocks[node.target]
            report.blocks[node.target] = _trace(
                block, set(), _defaults(block.forward, len(node.args), node.kwargs))
    for prefix, gm in report.graphs().items():
        _find_sites(gm.graph, prefix, report)
    return report


def _module_path(node: fx.Node, prefix: str) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    inner = list(stack.values())[-1][0] if stack else ""
    return ".".join(p for p in (prefix, inner) if p)


def _is_input(value) -> bool:
    return isinstance(value, fx.Node) and value.op == "placeholder"


def _is_sequence_size(node: fx.Node) -> bool:
    """x.shape[1], x.size(1), x.size(dim=1) or x.size()[1] of an input x (a placeholder)."""
    if node.op == "call_method" and node.target == "size" and _is_input(node.args[0]):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return type(dim) is int and dim == 1
    if node.target is operator.getitem and type(node.args[1]) is int and node.args[1] == 1:
        shape = node.args[0]  # x.shape or x.size()
        return isinstance(shape, fx.Node) and bool(shape.args) and _is_input(shape.args[0]) and (
            (shape.target is getattr and shape.args[1] == "shape")
            or (shape.target == "size" and len(shape.args) == 1 and not shape.kwargs))
    return False


def _find_sites(graph: fx.Graph, prefix: str, report: AttentionReport) -> None:
    sizes: set[fx.Node] = set()  # the sequence length, and integers computed from it
    for node in graph.nodes:
        uses_size = any(a in sizes for a in node.all_input_nodes)
        if _is_sequence_size(node) or (node.target in SIZE_ARITHMETIC and uses_size):
            sizes.add(node)
        elif node.op != "call_function":
            continue
        elif node.target is F.scaled_dot_product_attention:
            report.attention.append(Site(_module_path(node, prefix), prefix, node.name,
                                         _sdpa_problem(node)))
        elif node.target is torch.arange and uses_size:
            report.positions.append(Site(_module_path(node, prefix), prefix, node.name))
        elif (node.target is operator.getitem and uses_size
              and getattr(node.args[0], "op", None) == "get_attr"):
            report.positions.append(Site(
                _module_path(node, prefix), prefix, node.name,
                f"{node.args[0].target} is indexed by the sequence length (a position table?); "
                "positions must come from torch.arange"))


def sdpa_arguments(node: fx.Node) -> dict:
    return {**SDPA_DEFAULTS, **dict(zip(SDPA_ARGS, node.args)), **node.kwargs}


def _sdpa_problem(node: fx.Node) -> str | None:
    given = sdpa_arguments(node)
    for name, (allowed, what) in SUPPORTED.items():
        if isinstance(given[name], fx.Node):  # a tensor, or a value computed in forward
            return f"{what} ({name} computed in forward) is not supported: only {name}={allowed!r}"
        if given[name] != allowed:
            return f"{what} ({name}={given[name]!r}) is not supported: only {name}={allowed!r}"
    return None


def _meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


class _MetaRun(fx.Interpreter):
    """Runs a traced graph on meta tensors, keeping each node's value in node.meta["val"]
    (what fx's ShapeProp records). Modules run on meta copies of their parameters and buffers
    (torch.func.functional_call), so nothing real is touched or allocated; a traced block's
    call runs through the block's own graph."""

    def __init__(self, gm: fx.GraphModule, blocks: dict[str, fx.GraphModule]):
        super().__init__(gm)
        self.blocks = blocks

    def run_node(self, node: fx.Node):
        node.meta["val"] = super().run_node(node)
        return node.meta["val"]

    def get_attr(self, target, args, kwargs):
        return _meta(super().get_attr(target, args, kwargs))

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        if target in self.blocks:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            bound.apply_defaults()  # the traced block takes every argument positionally
            return _MetaRun(self.blocks[target], {}).run(*bound.arguments.values())
        state = {name: _meta(t) for name, t in
                 [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]}
        return torch.func.functional_call(module, state, tuple(args), kwargs)


def node_named(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def tensor_bytes(value, views: bool = True) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value)
               if isinstance(t, torch.Tensor) and (views or not t._is_view()))


def owned_bytes(gm: fx.GraphModule, skip=()) -> int:
    """Bytes of the intermediates that own their memory (a view shares its base's)."""
    return sum(tensor_bytes(n.meta.get("val"), views=False) for n in gm.graph.nodes
               if n.op.startswith("call_") and n.target not in skip)


def run_meta(report: AttentionReport, micro_batch: int, tokens: int) -> None:
    """Run the report's graphs on meta token ids (micro_batch, tokens), tensors made in the
    forward on the meta device too: every node's value is left in node.meta["val"]."""
    from loomtrain import comm

    with torch.device("meta"), comm.shapes_only():  # a tensor-parallel layer's collectives
        _MetaRun(report.top, report.blocks).run(torch.zeros(micro_batch, tokens, dtype=torch.long))
