"""What one forward of a model and its loss saves for backward, in bytes, per layer and for
the whole model: the activation formulas of models/gpt.py, models/mlp.py and models/llama.py
(docs/dry-run.md, "Activations"), which the dry run, the techniques that split the model and
the planner's cost model build on.
"""

from __future__ import annotations

from loomtrain.models.config import padded_vocab
from loomtrain.models.moe import is_moe_layer

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


def llama_layer_bytes(kind: str, b: int, t: int, m, c: int, tp: int = 1,
                      sequence_parallel: bool = False) -> int:
    """What one layer of models/llama.py (and the loss) saves for backward on one of `tp`
    ranks (parallel/tensor_llama.py), each tensor counted in the layer whose operation saves
    it. `m` has the [model] keys' shape: d_model, n_heads, kv_heads, head_width, ffn_width,
    vocab_size, qk_norm, sliding_window (a ModelConfig, or the planner's LlamaShape).

    RMSNorm (torch 2.13's F.rms_norm decomposes on CPU) works in fp32 whatever the compute
    dtype: it saves its input in fp32 (a bf16 input's fp32 copy), the rstd (1) and the
    normalized input (d), all fp32, and its consumer saves its output (c bytes). Under
    Megatron's sequence parallelism a norm sees 1/tp of the tokens, and the column layers
    keep the gathered, whole-sequence output.
    - embed: the int64 ids (the masked local ids under tp, with the bool mask of the ids
      outside this rank's vocabulary range); the rotation needs no position embedding;
    - block: ln1 and ln2 (fp32 2d + 1 each, output d each); q rotated, k and v expanded to
      this rank's heads (grouped-query attention's repeat_interleave saves nothing of the kv
      heads), the attention output (o_proj's input is a view of it), the SwiGLU's gate, up,
      silu and product (4 ffn), all in c bytes; fp32: the attention log-sum-exp (heads) and
      the rotation's cos and sin tables of q and k (4 t head_dim per layer, not per row). With
      sliding_window, the attention mask (t x t, c bytes: SDPA casts it to q's dtype). With
      qk_norm, q_norm and k_norm as RMSNorms over each head (fp32: inputs, normalized inputs
      and rstds of the q and kv heads), and o_proj's input becomes a copy (the normalized q
      is laid out (b, heads, t, head_dim), and the attention output follows it);
    - head: ln_f (its output as the head keeps it), the fp32 log-softmax (V), the int64
      targets and the loss's fp32 total weight; under tp the vocabulary-parallel loss's
      exponentials (V/tp, of the vocabulary padded to a multiple of tp) and per-token total
      (fp32), the int64 target and 2 bool masks.
    tests/test_dryrun.py holds it to the saved tensors, in fp32 and bf16, tp 1 and 2."""
    bt, d = b * t, m.d_model
    if kind == "embed":
        return INDEX_BYTES * bt + (bt if tp > 1 else 0)
    norm = FP32_BYTES * b * (t // (tp if sequence_parallel else 1)) * (2 * d + 1) + c * bt * d
    if kind == "head":
        if tp == 1:
            return norm + FP32_BYTES * (bt * m.vocab_size + 1) + INDEX_BYTES * bt
        rows = padded_vocab(m.vocab_size, tp) // tp
        return norm + FP32_BYTES * bt * (rows + 1) + INDEX_BYTES * bt + 2 * bt
    assert kind == "block", kind
    heads, kv, head_dim = llama_heads(m, tp)
    attention = c * bt * 4 * heads * head_dim + FP32_BYTES * (bt * heads + 4 * t * head_dim)
    mlp = c * bt * 4 * (m.ffn_width // tp)
    window = c * t * t if m.sliding_window else 0
    qk_norm = 0
    if m.qk_norm:
        qk_norm = (FP32_BYTES * bt * (heads + kv) * (2 * head_dim + 1)
                   + c * bt * heads * head_dim)
    return 2 * norm + attention + mlp + window + qk_norm


def moe_feed_forward_bytes(b: int, t: int, m, c: int) -> int:
    """What a mixture-of-experts feed-forward (models/moe.py) saves for backward, for b x t
    tokens T, K = T k token copies, E experts of width h and shared width s: the router's
    fp32 scores (T E) and the picks (int64 T k), with renormalization the picked weights (fp32
    T k) and their sum (T), with the sigmoid router the scores' sum (T); the copies' source and
    order indices (int64 2K); the experts' input rows (c K d), SwiGLU (c 4 K h) and the int32
    expert offsets their three grouped products share; the weighted combine's expert outputs and
    weights, and its weighted rows that index_add_ keeps (c K (2d + 1)); the shared experts' SwiGLU (c 4 T
    s), with Qwen's gate its sigmoid (c T) and the shared output (c T d); the balance loss's
    per-sequence shares (fp32 b E). Which expert gets which token does not change the sizes:
    dropless routing sends every copy somewhere."""
    tokens, copies = b * t, b * t * m.experts_per_token
    router = FP32_BYTES * tokens * m.n_experts + INDEX_BYTES * copies
    if m.router_norm_topk:
        router += FP32_BYTES * (copies + tokens)
    if m.router == "sigmoid":
        router += FP32_BYTES * tokens
    experts = (2 * INDEX_BYTES * copies + c * copies * (m.d_model + 4 * m.expert_width)
               + 4 * m.n_experts)  # the int32 row offsets the three grouped products share
    combine = c * copies * (2 * m.d_model + 1)
    shared = c * tokens * 4 * m.n_shared_experts * m.expert_width
    if m.shared_expert_gate:
        shared += c * tokens * (1 + m.d_model)
    return router + experts + combine + shared + FP32_BYTES * b * m.n_experts


def llama_core_bytes(b: int, t: int, m, c: int, tp: int = 1) -> int:
    """What recomputing the attention core of one llama block (recompute="selective",
    `attn.recompute_core`) frees of llama_layer_bytes: the checkpoint keeps its inputs (q
    and k rotated, v: the kv heads, not their expansion) and o_proj keeps the output; freed
    are the log-sum-exp (fp32, heads), the expanded k and v beyond the kv heads, the sliding
    window's mask, and with qk_norm the attention output (o_proj keeps its own copy)."""
    heads, kv, head_dim = llama_heads(m, tp)
    bt = b * t
    freed = FP32_BYTES * bt * heads + c * bt * 2 * (heads - kv) * head_dim
    if m.sliding_window:
        freed += c * t * t
    if m.qk_norm:
        freed += c * bt * heads * head_dim
    return freed


def llama_heads(m, tp: int) -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim) on one of `tp` ranks: the kv heads split when tp
    divides them, one (replicated) per rank when tp is a multiple of them (kv_layout)."""
    kv = m.kv_heads // tp if m.kv_heads % tp == 0 else 1
    return m.n_heads // tp, kv, m.head_width


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


def llama_activation_bytes(m, micro_batch: int, compute_bytes: int = FP32_BYTES, tp: int = 1,
                           sequence_parallel: bool = False) -> int:
    """Bytes saved for backward by models/llama.py plus the loss, on one of `tp` ranks: the
    sum of llama_layer_bytes's parts (`m` as there)."""
    parts = {kind: llama_layer_bytes(kind, micro_batch, m.seq_len, m, compute_bytes, tp,
                                     sequence_parallel) for kind in ("embed", "block", "head")}
    experts = sum(moe_extra_bytes(m, i, micro_batch, compute_bytes, tp, sequence_parallel)
                  for i in range(m.n_layers))
    return parts["embed"] + m.n_layers * parts["block"] + parts["head"] + experts


def moe_extra_bytes(m, layer: int, b: int, c: int, tp: int = 1,
                    sequence_parallel: bool = False) -> int:
    """What block `layer` saves beyond a dense llama block, on one of `tp` ranks: its mixture
    of experts' bytes (whole on every rank, over the rank's tokens: 1/tp of each sequence under
    sequence parallelism, parallel/tensor_llama.py) less the SwiGLU piece's (4 ffn / tp per
    token) it replaces, and under sequence parallelism less ln2's output beyond the rank's
    piece (a dense block's column layers keep it gathered); 0 for a dense block (or a shape
    without experts: the planner's)."""
    if not getattr(m, "n_experts", 0) or not is_moe_layer(m, layer):
        return 0
    return moe_block_extra_bytes(b, m.seq_len, m, c, tp, sequence_parallel)


def moe_block_extra_bytes(b: int, t: int, m, c: int, tp: int = 1,
                          sequence_parallel: bool = False) -> int:
    """`moe_extra_bytes` of a MoE block over b rows of t tokens (the planner's shape gives a
    cp rank's t)."""
    mine = t // tp if sequence_parallel else t
    return (moe_feed_forward_bytes(b, mine, m, c) - c * b * t * 4 * (m.ffn_width // tp)
            - c * b * (t - mine) * m.d_model)


def activation_bytes(model_cfg, micro_batch: int, compute_bytes: int = FP32_BYTES) -> int:
    """One micro-batch's saved activations: accumulation runs micro-batches one after another,
    and each backward frees its graph, so only one is alive at a time."""
    m = model_cfg
    if m.name == "llama":
        return llama_activation_bytes(m, micro_batch, compute_bytes)
    if m.name == "gpt":
        return gpt_activation_bytes(micro_batch, m.seq_len, m.d_model, m.n_layers, m.n_heads,
                                    m.mlp_ratio, m.vocab_size, compute_bytes)
    if m.name == "mlp":
        return mlp_activation_bytes(micro_batch, m.seq_len, m.d_model, m.n_layers,
                                    m.mlp_ratio, m.vocab_size, compute_bytes)
    raise AssertionError(f"no activation formula for model {m.name!r}")
