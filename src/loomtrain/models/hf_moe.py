"""The mixture-of-experts part of Hugging Face interop (models/hf.py): Mixtral, Qwen2-MoE and
Qwen3-MoE folders. Their experts are saved one matrix per expert ([out, in], nn.Linear's layout;
transformers 5 stacks them in memory but still saves them so); loomtrain stacks them
([experts, in, out], models/moe.py). What maps and what is refused: docs/moe.md, "Hugging Face
checkpoints".
"""

from __future__ import annotations

# model_type -> (architecture, the dense family whose attention it has)
MOE_FAMILY = {"mixtral": ("MixtralForCausalLM", "mistral"),
              "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2"),
              "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3")}
# an expert's three matrices: loomtrain's name, Mixtral's, Qwen's
_EXPERT = (("gate_proj", "w1", "gate_proj"), ("up_proj", "w3", "up_proj"),
           ("down_proj", "w2", "down_proj"))


def moe_keys(path, hf: dict, refuse) -> dict:
    """The mixture-of-experts [model] keys of a Mixtral or Qwen-MoE config.json; `refuse(path,
    what)` makes the error."""
    kind = hf["model_type"]
    if kind == "mixtral":  # every layer MoE, one width (intermediate_size), renormalized top k
        if hf.get("router_jitter_noise", 0.0):
            raise refuse(path, f"router_jitter_noise={hf['router_jitter_noise']} perturbs the "
                         "router in training, which loomtrain's does not")
        return {"n_experts": hf["num_local_experts"], "experts_per_token": hf["num_experts_per_tok"]}
    if hf.get("mlp_only_layers"):
        raise refuse(path, f"mlp_only_layers={hf['mlp_only_layers']} makes chosen layers dense; "
                     "loomtrain places them by decoder_sparse_step (model.moe_every) alone")
    # published Qwen configs say num_experts; transformers 5 saves num_local_experts
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    keys = {"n_experts": experts, "experts_per_token": hf["num_experts_per_tok"],
            "moe_every": hf.get("decoder_sparse_step", 1), "moe_hidden": hf["moe_intermediate_size"],
            "router_norm_topk": bool(hf.get("norm_topk_prob", False))}
    if kind == "qwen2_moe":
        shared, width = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
        if shared % width:
            raise refuse(path, f"shared_expert_intermediate_size={shared} is not a multiple of "
                         f"moe_intermediate_size={width}; loomtrain's shared experts are "
                         "model.n_shared_experts experts of the routed width")
        keys.update(n_shared_experts=shared // width, shared_expert_gate=True)
    return keys


def moe_names(keys: dict, layer: int) -> dict[str, tuple]:
    """{loomtrain name: (Hugging Face name or the experts' names in order, transposed)} of MoE
    block `layer`, for the family `keys` export to or came from (`moe_type`)."""
    ours, theirs = f"blocks.{layer}.mlp", f"model.layers.{layer}"
    mixtral = moe_type(keys) == "mixtral"
    moe = f"{theirs}.block_sparse_moe" if mixtral else f"{theirs}.mlp"
    names = {f"{ours}.router.gate.weight": (f"{moe}.gate.weight", False)}
    for mine, mixtral_name, qwen_name in _EXPERT:
        own = mixtral_name if mixtral else qwen_name
        names[f"{ours}.experts.{mine}"] = (
            tuple(f"{moe}.experts.{e}.{own}.weight" for e in range(keys["n_experts"])), True)
    if keys["n_shared_experts"]:
        for mine, _, qwen_name in _EXPERT:
            names[f"{ours}.shared.{mine}.weight"] = (f"{moe}.shared_expert.{qwen_name}.weight", False)
        names[f"{ours}.shared_gate.weight"] = (f"{moe}.shared_expert_gate.weight", False)
    return names


def moe_type(keys: dict) -> str:
    """The Hugging Face family a llama model with experts is (ValueError where none is):
    Qwen2-MoE with gated shared experts (and q/k/v biases), Qwen3-MoE with qk_norm, else
    Mixtral, which has one feed-forward width and every layer MoE with renormalized weights."""
    problems = [why for bad, why in (
        (keys["router"] != "softmax", 'model.router="sigmoid" (DeepSeek-V3\'s, not mapped)'),
        (keys["n_shared_experts"] and not (keys["shared_expert_gate"] and keys["qkv_bias"]),
         "shared experts without Qwen2-MoE's gate and q/k/v biases"),
        (keys["qk_norm"] and keys["n_shared_experts"], "qk_norm with shared experts"),
        (keys["qkv_bias"] and not keys["n_shared_experts"], "qkv_bias without shared experts"))
        if bad]
    if keys["n_shared_experts"]:
        kind = "qwen2_moe"
    elif keys["qk_norm"]:
        kind = "qwen3_moe"
    else:
        kind = "mixtral"
        problems += [why for bad, why in (
            (keys["moe_every"] != 1, f"model.moe_every={keys['moe_every']} (Mixtral's layers are "
             "all MoE)"),
            (not keys["router_norm_topk"], "model.router_norm_topk=false (Mixtral renormalizes)"),
            (keys["moe_hidden"] not in (0, keys["ffn_hidden"]) and keys["ffn_hidden"],
             "an expert width other than ffn_hidden (Mixtral has one)")) if bad]
    if problems:
        raise ValueError(f"to_hf: no Hugging Face architecture has this mixture of experts: "
                         f"{'; '.join(problems)}")
    return kind


def moe_config(cfg) -> dict:
    """The config.json keys of a llama ModelConfig `cfg` with experts (model_type and
    architecture included), on top of the dense family's."""
    keys = cfg.model_dump()
    kind = moe_type(keys)
    if kind == "mixtral":
        return {"model_type": kind, "architectures": [MOE_FAMILY[kind][0]],
                "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
                "intermediate_size": cfg.expert_width, "router_jitter_noise": 0.0}
    config = {"model_type": kind, "architectures": [MOE_FAMILY[kind][0]],
              "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
              "decoder_sparse_step": cfg.moe_every, "moe_intermediate_size": cfg.expert_width,
              "norm_topk_prob": cfg.router_norm_topk, "mlp_only_layers": []}
    if kind == "qwen2_moe":
        config.update(shared_expert_intermediate_size=cfg.n_shared_experts * cfg.expert_width,
                      qkv_bias=True)
    return config


__all__ = ["MOE_FAMILY", "moe_config", "moe_keys", "moe_names", "moe_type"]
