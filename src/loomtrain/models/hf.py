"""Hugging Face checkpoints in and out: a model folder (config.json and model.safetensors, or
shards named by model.safetensors.index.json) of LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel or a mixture of experts (MixtralForCausalLM,
Qwen2MoeForCausalLM, Qwen3MoeForCausalLM: hf_moe.py) read as [model] keys and a state dict in
loomtrain's names (`from_hf`), and a loomtrain model written as such a folder (`to_hf`).

Only `safetensors` is needed; `transformers` is not imported. What maps, the name table and what
is refused: docs/models.md, "Hugging Face checkpoints".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loomtrain.models.config import LLAMA_DEFAULTS
from loomtrain.models.hf_moe import MOE_FAMILY, moe_config, moe_keys, moe_names
from loomtrain.models.moe import is_moe_layer

INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GPT2 = "GPT2LMHeadModel"
# GPT-2's causal-mask buffers, saved by old transformers releases: not weights
_GPT2_MASKS = (".attn.bias", ".attn.masked_bias")
# GPT-2's activation_function -> model.activation: the exact GELU, or the tanh approximation
# under transformers' two names for it (GPT2Config's default, the published models', is
# "gelu_new")
_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def is_hf_folder(path: Path) -> bool:
    """Whether `path` holds a Hugging Face model: config.json beside safetensors weights."""
    path = Path(path)
    return (path / "config.json").is_file() and ((path / WEIGHTS).is_file()
                                                 or (path / INDEX).is_file())


def _refuse(path, what: str) -> ValueError:
    return ValueError(f"Hugging Face model {str(path)!r}: {what}")


def _require(path, hf: dict, key: str, allowed, why: str) -> None:
    """Refuses `hf[key]` outside `allowed` (a missing key reads as the first allowed value)."""
    value = hf.get(key, allowed[0])
    if value not in allowed:
        raise _refuse(path, f"{key}={value!r} {why}; loomtrain maps only {key} in {list(allowed)}")


def _rope_keys(path, hf: dict) -> dict:
    """rope_theta and rope_scaling from transformers 5's `rope_parameters` or the older
    top-level `rope_theta` and `rope_scaling`."""
    rope = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}),
                                         "rope_theta": hf.get("rope_theta", 10000.0)}
    kind = rope.get("rope_type", rope.get("type", "default"))
    _require(path, {**hf, **rope}, "partial_rotary_factor", [1.0], "rotates part of each head")
    keys = {"rope_theta": float(rope["rope_theta"]), "rope_scaling": None}
    if kind == "llama3":
        keys["rope_scaling"] = {"factor": rope["factor"], "low_freq_factor": rope["low_freq_factor"],
                                "high_freq_factor": rope["high_freq_factor"],
                                "original_max_position": rope["original_max_position_embeddings"]}
    elif kind == "linear":
        keys["rope_scaling"] = {"rope_type": "linear", "factor": rope["factor"]}
    elif kind != "default":
        raise _refuse(path, f"rope_type={kind!r} is not mapped; loomtrain has the plain rotation "
                      "(\"default\"), position interpolation (\"linear\") and Llama 3's "
                      "scaling (\"llama3\")")
    return keys


def _llama_keys(path, hf: dict) -> dict:
    """The [model] keys of a Llama-family config.json (seq_len stays the run's); a mixture of
    experts has its dense family's attention (MOE_FAMILY) and its own keys (hf_moe.py)."""
    moe = hf["model_type"] in MOE_FAMILY
    kind = MOE_FAMILY[hf["model_type"]][1] if moe else hf["model_type"]
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    _require(path, hf, "hidden_act", ["silu"], "is not SwiGLU's")
    _require(path, hf, "mlp_bias", [False], "puts biases on the MLP, which loomtrain's has not")
    # Llama's and Qwen3's attention_bias also biases o_proj; Qwen2 biases q, k, v always
    _require(path, hf, "attention_bias", [False], "biases o_proj too, which loomtrain does not")
    if kind in ("qwen2", "qwen3"):
        _require(path, hf, "use_sliding_window", [False], "windows only some layers")
    if hf["model_type"] == "qwen2_moe":
        _require(path, hf, "qkv_bias", [True], "leaves out Qwen2's q/k/v biases")
    window = hf.get("sliding_window") if kind == "mistral" else None
    return {**(moe_keys(path, hf, _refuse) if moe else {}), "name": "llama", "vocab_size": hf["vocab_size"], "d_model": width,
            "n_layers": hf["num_hidden_layers"], "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads") or heads,
            # 0: hidden_size / num_attention_heads, so a run that leaves head_dim out matches
            "head_dim": 0 if hf.get("head_dim") in (None, width // heads) else hf["head_dim"],
            "ffn_hidden": hf["intermediate_size"], **_rope_keys(path, hf),
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qkv_bias": kind == "qwen2", "qk_norm": kind == "qwen3", "sliding_window": window or 0}


def _gpt2_keys(path, hf: dict) -> dict:
    """The [model] keys of a GPT-2 config.json; seq_len is n_positions (the rows of wpe)."""
    width = hf["n_embd"]
    inner = hf.get("n_inner") or 4 * width
    if inner % width:
        raise _refuse(path, f"n_inner={inner} is not a multiple of n_embd={width}; loomtrain's "
                      "GPT sizes its MLP by model.mlp_ratio")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise _refuse(path, f"activation_function={activation!r} is not mapped; loomtrain's GPT "
                      "has the exact GELU (\"gelu\") and its tanh approximation (\"gelu_new\", "
                      "\"gelu_pytorch_tanh\")")
    _require(path, hf, "layer_norm_epsilon", [1e-5], "is not torch's LayerNorm default")
    _require(path, hf, "scale_attn_weights", [True], "changes the attention scale")
    _require(path, hf, "scale_attn_by_inverse_layer_idx", [False], "changes the attention scale")
    _require(path, hf, "add_cross_attention", [False], "adds cross-attention")
    _require(path, hf, "tie_word_embeddings", [True], "unties the head, which loomtrain's GPT ties")
    return {"name": "gpt", "vocab_size": hf["vocab_size"], "seq_len": hf["n_positions"],
            "d_model": width, "n_layers": hf["n_layer"], "n_heads": hf["n_head"],
            "mlp_ratio": inner // width, "activation": _GPT2_ACTIVATIONS[activation]}


def hf_keys(path) -> dict:
    """The [model] keys of the Hugging Face model folder `path` (ValueError: unmappable)."""
    hf = json.loads((Path(path) / "config.json").read_text())
    architectures = hf.get("architectures") or [None]
    if architectures[0] == GPT2:
        return _gpt2_keys(path, hf)
    kind = hf.get("model_type")
    if architectures[0] in (LLAMA_FAMILY.get(kind), MOE_FAMILY.get(kind, ("",))[0]):
        return _llama_keys(path, hf)
    known = [*LLAMA_FAMILY.values(), *(a for a, _ in MOE_FAMILY.values()), GPT2]
    raise _refuse(path, f"architectures={architectures} (model_type={kind!r}) "
                  f"is not mapped; loomtrain reads {', '.join(known)}")


# a GPT block's layers: (loomtrain, GPT-2, GPT-2 keeps the weight transposed: Conv1D)
_GPT2_BLOCK = (("ln1", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
               ("attn.proj", "attn.c_proj", True), ("ln2", "ln_2", False),
               ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True))
# a llama block's module prefixes that Hugging Face names otherwise
_LLAMA_RENAMES = {"ln1.": "input_layernorm.", "ln2.": "post_attention_layernorm.",
                  "attn.": "self_attn."}


def _gpt2_names(keys: dict) -> dict[str, tuple[str, bool]]:
    """GPT-2's Conv1D layers keep their weights as (in, out), the transpose of nn.Linear's;
    its c_attn holds q, k, v concatenated along the output, as the GPT's qkv does."""
    names = {"tok_emb.weight": ("transformer.wte.weight", False),
             "pos_emb.weight": ("transformer.wpe.weight", False),
             "ln_f.weight": ("transformer.ln_f.weight", False),
             "ln_f.bias": ("transformer.ln_f.bias", False),
             "head.weight": ("transformer.wte.weight", False)}  # tied
    for i in range(keys["n_layers"]):
        for ours, theirs, transposed in _GPT2_BLOCK:
            names[f"blocks.{i}.{ours}.weight"] = (f"transformer.h.{i}.{theirs}.weight", transposed)
            names[f"blocks.{i}.{ours}.bias"] = (f"transformer.h.{i}.{theirs}.bias", False)
    return names


def _llama_names(keys: dict) -> dict[str, tuple]:
    """The llama model's names are Hugging Face's inside attention and the MLP already; a MoE
    block's feed-forward maps by hf_moe.py."""
    tied = keys["tie_embeddings"]
    pairs = {"tok_emb.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
             "head.weight": "model.embed_tokens.weight" if tied else "lm_head.weight"}
    block = ["ln1.weight", "ln2.weight", "attn.q_proj.weight", "attn.k_proj.weight",
             "attn.v_proj.weight", "attn.o_proj.weight"]
    dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if keys["qkv_bias"]:
        block += ["attn.q_proj.bias", "attn.k_proj.bias", "attn.v_proj.bias"]
    if keys["qk_norm"]:
        block += ["attn.q_norm.weight", "attn.k_norm.weight"]
    experts = {}
    for i in range(keys["n_layers"]):
        moe = is_moe_layer(SimpleNamespace(n_experts=keys.get("n_experts", 0),
                                           moe_every=keys.get("moe_every", 1)), i)
        for ours in block + ([] if moe else dense):
            theirs = next((new + ours[len(old):] for old, new in _LLAMA_RENAMES.items()
                           if ours.startswith(old)), ours)
            pairs[f"blocks.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
        if moe:
            experts.update(moe_names(keys, i))
    return {**{ours: (theirs, False) for ours, theirs in pairs.items()}, **experts}



def name_map(keys: dict) -> dict[str, tuple]:
    """{loomtrain name: (Hugging Face name, stored transposed)} of the model `keys` (the
    [model] keys) describe. A tied head maps to the embedding's name; stacked experts map to
    a tuple of names, one matrix per expert, each transposed when the flag says so."""
    return _gpt2_names(keys) if keys["name"] == "gpt" else _llama_names(keys)


def read_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors, or of the shards its index names."""
    path = Path(path)
    files = [WEIGHTS]
    if (path / INDEX).is_file():
        files = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    tensors = {}
    for file in files:
        with safe_open(str(path / file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def from_hf(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """([model] keys, state dict in loomtrain's names) of the Hugging Face model folder `path`.
    The tensors keep the folder's dtype. ValueError names what cannot be mapped: the
    architecture, a config value loomtrain's model lacks, a missing or an unused tensor."""
    keys = hf_keys(path)
    tensors = read_tensors(path)
    if keys["name"] == "gpt":  # the Hub's gpt2 has no "transformer." prefix
        tensors = {n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}": t
                   for n, t in tensors.items() if not n.endswith(_GPT2_MASKS)}
    names = name_map({**LLAMA_DEFAULTS, **keys})  # a dense family's keys lack the MoE ones
    wanted = {n for theirs, _ in names.values() for n in _each(theirs)}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise _refuse(path, f"tensor {missing[0]!r} is missing ({len(missing)} in all)")
    # a tied head is the embedding; a file that also saves lm_head holds a copy of it
    unused = sorted(set(tensors) - wanted - {"lm_head.weight"})
    if unused:
        raise _refuse(path, f"tensor {unused[0]!r} has no place in loomtrain's model "
                      f"({len(unused)} unmapped in all)")
    state = {ours: _read(tensors, theirs, transposed) for ours, (theirs, transposed) in names.items()}
    for name in [n for n in state if n.endswith(".router.gate.weight")]:  # no routing bias
        state[name.replace(".gate.weight", ".expert_bias")] = torch.zeros(state[name].shape[0])
    return keys, {name: t.contiguous() for name, t in state.items()}


def _each(theirs) -> tuple[str, ...]:
    return theirs if isinstance(theirs, tuple) else (theirs,)


def _read(tensors: dict, theirs, transposed: bool) -> torch.Tensor:
    """One of our tensors from theirs: a tuple of names is the experts' matrices, stacked."""
    parts = [tensors[n].t() if transposed else tensors[n] for n in _each(theirs)]
    return torch.stack(parts) if isinstance(theirs, tuple) else parts[0]


def _llama_config(cfg) -> dict:
    """The config.json keys of a llama-family ModelConfig `cfg`: Qwen3 for qk_norm, Qwen2 for
    qkv_bias, Mistral for a sliding window, else Llama; with experts their MoE family (hf_moe.py)
    (ValueError where none fits)."""
    kind = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "mistral" if cfg.sliding_window else "llama"
    if (cfg.qk_norm and cfg.qkv_bias) or (kind in ("qwen2", "qwen3") and cfg.sliding_window):
        raise ValueError("to_hf: no Hugging Face architecture has the combination of "
                         f"model.qk_norm={cfg.qk_norm}, model.qkv_bias={cfg.qkv_bias} and "
                         f"model.sliding_window={cfg.sliding_window}")
    config = {"model_type": kind, "architectures": [LLAMA_FAMILY[kind]],
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_width,
              "intermediate_size": cfg.ffn_width, "hidden_act": "silu",
              "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
              "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
              "attention_bias": False, "sliding_window": cfg.sliding_window or None}
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": s.factor}
    elif s is not None:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                                  "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_position}
    if cfg.n_experts:
        config.update(moe_config(cfg))
    return config


def _gpt2_config(cfg) -> dict:
    """The GPT2Config keys of a GPT ModelConfig `cfg` (ValueError for linear attention)."""
    if cfg.attention != "softmax":
        raise ValueError(f"to_hf: model.attention={cfg.attention!r} has no GPT-2 equivalent")
    return {"model_type": "gpt2", "architectures": [GPT2], "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_inner": cfg.mlp_ratio * cfg.d_model,
            "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "tie_word_embeddings": True}


def to_hf(model: torch.nn.Module, model_cfg, out_dir, tokenizer_path=None) -> Path:
    """Writes `model` (built from the ModelConfig `model_cfg`) as a Hugging Face model folder
    that `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads: config.json,
    model.safetensors in the model's dtype (a tied head once, under the embedding's name, as
    transformers saves it) and, given a tokenizer.json, it and a minimal tokenizer_config.json."""
    if model_cfg.name not in ("gpt", "llama"):
        raise ValueError(f"to_hf: model.name={model_cfg.name!r} has no Hugging Face architecture")
    config = _gpt2_config(model_cfg) if model_cfg.name == "gpt" else _llama_config(model_cfg)
    keys = model_cfg.model_dump()
    state = model.state_dict()
    biased = [n for n, t in state.items() if n.endswith(".expert_bias") and t.any()]
    if biased:
        raise ValueError(f"to_hf: {biased[0]} is not zero (model.router_bias_rate trained it) and "
                         "Mixtral and Qwen-MoE have no routing bias to hold it")
    tensors = {}
    for ours, (theirs, transposed) in name_map(keys).items():
        parts = state[ours].unbind(0) if isinstance(theirs, tuple) else (state[ours],)
        tensors.update({name: (t.t() if transposed else t).contiguous()
                        for name, t in zip(_each(theirs), parts)})
    dtype = next(iter(tensors.values())).dtype
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    # loomtrain's models know no special tokens; transformers' defaults (GPT-2's 50256) would
    # name ids the vocabulary may not have
    config.update(bos_token_id=None, eos_token_id=None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_cfg.seq_len},
            indent=2) + "\n")
    return out


__all__ = ["from_hf", "hf_keys", "is_hf_folder", "name_map", "read_tensors", "to_hf"]
