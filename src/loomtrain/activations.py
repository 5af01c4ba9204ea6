"""What one forward of a model and its loss saves for backward, in bytes, per layer and for
the whole model: the activation formulas of models/gpt.py and models/mlp.py (docs/dry-run.md,
"Activations"), which the dry run and the techniques that split the model build on.
"""

from __future__ import annotations

FP32_BYTES, INDEX_BYTES = 4, 8  # log-sum-exp, log-softmax, loss weight; int64 ids


def gpt_layer_bytes(kind: str, b: int, t: int, d: int, h: int, r: int, V: int, c: int) -> int:
    """What one layer of models/gpt.py (and the loss) saves for backward, each tensor counted
    in the layer whose operation saves it (dropout 0):
    - embed: the int64 token ids (b t) and positions (t); the embedding sum is saved by block 0;
    - block: its input (ln1 saves it), ln1 output, qkv (3d: q, k and v are views of it), the
      attention output (the proj input is a view of it), the residual after attention, ln2
      output, fc output and GELU output (rd each): 8d + 2rd per token, with both LayerNorms'
      mean and rstd (4) in the compute dtype; the attention's fp32 log-sum-exp (h);
    - head: ln_f's input (the last block's output) and output, its statistics (2d + 2), the
      fp32 log-softmax output V that cross-entropy keeps, the int64 targets and the loss's fp32
      total weight."""
    bt = b * t
    if kind == "embed":
        return INDEX_BYTES * (bt + t)
    if kind == "block":
        return c * bt * (8 * d + 2 * r * d + 4) + FP32_BYTES * bt * h
    assert kind == "head", kind
    return c * bt * (2 * d + 2) + FP32_BYTES * (bt * V + 1) + INDEX_BYTES * bt


def mlp_layer_bytes(kind: str, b: int, t: int, d: int, r: int, V: int, c: int) -> int:
    """As gpt_layer_bytes for models/mlp.py: embed the int64 ids; a block its input, LayerNorm
    output and statistics, fc and GELU outputs (2d + 2rd + 2); the head as the GPT's."""
    bt = b * t
    if kind == "embed":
        return INDEX_BYTES * bt
    if kind == "block":
        return c * bt * (2 * d + 2 * r * d + 2)
    return gpt_layer_bytes("head", b, t, d, 0, r, V, c)


def gpt_activation_bytes(micro_batch: int, seq_len: int, d_model: int, n_layers: int,
                         n_heads: int, mlp_ratio: int, vocab_size: int,
                         compute_bytes: int = FP32_BYTES) -> int:
    """Bytes autograd saves for backward in one forward of models/gpt.py plus the loss (dropout 0).

    Per token and layer, in the compute dtype (c bytes): ln1 output d, qkv 3d (q, k, v are
    views of it), attention output d (the proj input is a view of it: the fused SDPA kernel
    writes it as b,t,h,dh), residual after attention d, ln2 output d, fc output rd, GELU output
    rd, block output d, so 8d + 2rd; plus mean and rstd of both LayerNorms (4, in the input's
    dtype on CPU). In fp32 always: the attention log-sum-exp (h). Once per token: the embedding
    sum (block 0 input) d, ln_f output d and stats 2 (compute dtype), and the fp32 log-softmax
    output V that cross-entropy keeps (the loss casts the logits to fp32). Ids and targets are
    int64 per token, positions int64 per position, and cross-entropy keeps one fp32 total
    weight. The flash/efficient attention kernels save no t x t matrix; this counts every
    tensor measured by tests/test_dryrun.py on torch 2.13 CPU, in fp32 and bf16, to the byte.
    It is the sum of the per-layer parts (embed, blocks, head) the pipeline's stages use.
    """
    parts = {kind: gpt_layer_bytes(kind, micro_batch, seq_len, d_model, n_heads, mlp_ratio,
                                   vocab_size, compute_bytes) for kind in ("embed", "block", "head")}
    return parts["embed"] + n_layers * parts["block"] + parts["head"]


def mlp_activation_bytes(micro_batch: int, seq_len: int, d_model: int, n_layers: int,
                         mlp_ratio: int, vocab_size: int, compute_bytes: int = FP32_BYTES) -> int:
    """Bytes saved for backward by models/mlp.py plus the loss.

    Per token and layer (compute dtype): LayerNorm output d and stats 2, fc output rd, GELU
    output rd, block output d. Once per token: the embedding output d, ln_f output d and stats
    2 (compute dtype), the fp32 log-softmax output V; int64 ids and targets; one fp32 total
    weight. The sum of its per-layer parts, as gpt_activation_bytes.
    """
    parts = {kind: mlp_layer_bytes(kind, micro_batch, seq_len, d_model, mlp_ratio, vocab_size,
                                   compute_bytes) for kind in ("embed", "block", "head")}
    return parts["embed"] + n_layers * parts["block"] + parts["head"]


def activation_bytes(model_cfg, micro_batch: int, compute_bytes: int = FP32_BYTES) -> int:
    """One micro-batch's saved activations: accumulation runs micro-batches one after another,
    and each backward frees its graph, so only one is alive at a time."""
    m = model_cfg
    if m.name == "gpt":
        return gpt_activation_bytes(micro_batch, m.seq_len, m.d_model, m.n_layers, m.n_heads,
                                    m.mlp_ratio, m.vocab_size, compute_bytes)
    if m.name == "mlp":
        return mlp_activation_bytes(micro_batch, m.seq_len, m.d_model, m.n_layers,
                                    m.mlp_ratio, m.vocab_size, compute_bytes)
    raise AssertionError(f"no activation formula for model {m.name!r}")
