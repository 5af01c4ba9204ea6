"""Tensor parallelism by a plan: module-name patterns (fnmatch) mapped to "column", "row" or
"column:N" (a fused projection: N equal parts, each split by column), applied to any model
whose nn.Linear layers (or GPT-2's Conv1D, a linear layer with its weight stored (in, out))
pair up that way. The plan is checked against the model before any
layer is replaced: every pattern must split something, fused projections must declare their
parts, and attention heads must split evenly. Details: docs/tensor.md, "Plans".
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn

from loomtrain.parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear, _contiguous, _split

# Hugging Face's Llama-style decoders (Llama, Mistral, Qwen2): attention and MLP as Megatron
# pairs. Their attention reshapes by head_dim, so it runs on the local heads unchanged.
LLAMA_HF_PLAN = {
    "*.self_attn.q_proj": "column", "*.self_attn.k_proj": "column",
    "*.self_attn.v_proj": "column", "*.self_attn.o_proj": "row",
    "*.mlp.gate_proj": "column", "*.mlp.up_proj": "column", "*.mlp.down_proj": "row",
}

# GPT-2 (transformers' GPT2LMHeadModel): its Conv1D layers as Megatron pairs, c_attn as
# [q; k; v]. Its attention cuts c_attn's output by `split_size`, which the split sets to the
# local width (`_local_split_size`); it reshapes by head_dim, as Llama's does.
GPT2_HF_PLAN = {"*.attn.c_attn": "column:3", "*.attn.c_proj": "row",
                "*.mlp.c_fc": "column", "*.mlp.c_proj": "row"}

# names of fused projections (Phi-3's gate_up_proj, GPT-2's c_attn, Phi-3's qkv_proj): one
# contiguous column split would hand a rank the wrong parts
FUSED_NAMES = ("*gate_up_proj", "*c_attn", "*qkv_proj")


def fused_rows(n: int, fused: int, rank: int, parts: int, what: str) -> torch.Tensor:
    """My rows of an output of `n` features made of `fused` equal parts ([q; k; v], [gate;
    up]): the same contiguous range of each part."""
    size = _split(n, fused, f"{what} (in {fused} fused parts)")
    mine = _contiguous(size, rank, parts, f"{what} / {fused}")
    return torch.cat([mine + j * size for j in range(fused)])


def _kind(value: str) -> tuple[str, int]:
    """("column" | "row", fused parts) of a plan value."""
    kind, _, fused = value.partition(":")
    if kind == "row" and not fused:
        return kind, 1
    if kind == "column" and (not fused or (fused.isdigit() and int(fused) >= 2)):
        return kind, int(fused or 1)
    raise ValueError(f"tensor-parallel plan: {value!r} is not 'column', 'row' or 'column:N' "
                     "(N >= 2 fused parts)")


def _heads(attention: nn.Module) -> dict[str, int]:
    """The head counts of an attention module (loomtrain's `num_heads`, or a Hugging Face
    attention's config), {} for a module without heads."""
    config = getattr(attention, "config", None)
    if not (hasattr(attention, "num_heads") or hasattr(attention, "head_dim")):
        return {}
    found = {}
    for attr, key in (("num_heads", "num_attention_heads"),
                      ("num_key_value_heads", "num_key_value_heads")):
        value = getattr(attention, attr, getattr(config, key, None))
        if isinstance(value, int):
            found[attr] = value
    return found


def _widths(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in features, out features, weight stored (in, out)) of an nn.Linear or of GPT-2's
    Conv1D (known by its class name: the library does not import transformers); None for
    any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[0], weight.shape[1], True
    return None


def _local_split_size(attention: nn.Module, part: int, parts: int) -> None:
    """An attention that cuts its fused projection's output into parts of `split_size`
    features (GPT-2's, d_model) gets my share of a part, as tensor_llama.py sets the local
    n_heads: it is the width its own forward then reads."""
    if getattr(attention, "split_size", None) == part:
        attention.split_size = part // parts


def _check(model: nn.Module, name: str, kind: str, fused: int, parts: int) -> None:
    """Refuse a split the model cannot run: a fused projection split as one column, heads
    that do not split evenly over the tp ranks."""
    if kind == "column" and fused == 1 and any(fnmatch.fnmatchcase(name, f) for f in FUSED_NAMES):
        raise ValueError(f"tensor-parallel plan: {name} looks like a fused projection; a plain "
                         "'column' split would give ranks whole parts, not a slice of each: "
                         "declare its N parts as 'column:N' ('column:2' for [gate; up], "
                         "'column:3' for [q; k; v])")
    parent = name.rpartition(".")[0]
    for attr, heads in _heads(model.get_submodule(parent) if parent else model).items():
        _split(heads, parts, f"{parent}.{attr}")


def apply_plan(model: nn.Module, mesh, axis: str, plan: dict[str, str]) -> nn.Module:
    """`model` with the layers `plan` names replaced by their tp pieces (parallelize_tensor)."""
    parts, rank = mesh.size(axis), mesh.local_rank(axis)
    kinds = {pattern: _kind(value) for pattern, value in plan.items()}
    chosen = {}
    for name, module in model.named_modules():
        pattern = next((p for p in plan if fnmatch.fnmatchcase(name, p)), None)
        if pattern is None:
            continue
        if _widths(module) is None:
            raise ValueError(f"tensor-parallel plan: {name} is a {type(module).__name__}, "
                             "not an nn.Linear or a Conv1D (GPT-2's)")
        _check(model, name, *kinds[pattern], parts)
        chosen[name] = (module, *kinds[pattern])
    unused = [p for p in plan if not any(fnmatch.fnmatchcase(n, p) for n in chosen)]
    if unused:
        raise ValueError(f"tensor-parallel plan: {', '.join(map(repr, unused))} splits no "
                         "module of the model (patterns match full module names, e.g. "
                         "'model.layers.*.self_attn.q_proj')")
    for name, (module, kind, fused) in chosen.items():
        n_in, n_out, transposed = _widths(module)
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if kind == "column":
            rows = fused_rows(n_out, fused, rank, parts, f"{name}.out_features")
            piece = ColumnParallelLinear(module, rows, mesh, axis, transposed=transposed)
            if fused > 1:
                _local_split_size(owner, n_out // fused, parts)
        else:
            cols = _contiguous(n_in, rank, parts, f"{name}.in_features")
            piece = RowParallelLinear(module, cols, mesh, axis, transposed=transposed)
        setattr(owner, leaf, piece)
    return model
