"""What the cost model (cost.py) reads of a model: `Shape`'s fields, and the members each
family's shape adds (presets.py ModelShape, the GPT's; llama_shape.py LlamaShape):
`params`, `block_params`, `embedding_params`, `head_params` and `tied_head` (parameters per
layer), `tp_params` (what one tp rank holds of a layer), `block_matmul_params` (FLOPs),
`traffic_h` and `ops` (memory-bound traffic and launches), `stash_bytes` and `core_bytes`
(activations, selective recompute), `tp_calls` (tensor-parallel collectives), `kv_width`
(what the cp ring passes) and `model_keys` (the [model] table of a planned config).
A mixture of experts (the llama's only) adds `n_experts`, `experts_per_token`, `is_moe`,
`moe_block_params`, `moe_feed_forward_params`, `moe_matmul_params`,
`moe_feed_forward_matmul_params` and `expert_params`, and the kind "moe" to the per-kind
members.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int

    n_experts = 0  # routed experts per MoE block: a class attribute here (dense), the llama's field

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` (from 0) is a mixture of experts: never in a dense family."""
        return False


__all__ = ["Shape"]
