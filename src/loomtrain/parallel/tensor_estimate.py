"""What tensor parallelism costs per rank: the collectives of one optimizer step and the
activations of one micro-batch, as pure functions of the config's numbers (the dry run prints
them, `estimate_tensor`; tests/test_dryrun.py holds them to the meter and to the tensors
autograd saves). Notation: docs/tensor.md, "Dry run".
"""

from __future__ import annotations

from loomtrain.activations import (FP32_BYTES, INDEX_BYTES, llama_activation_bytes,
                                   mlp_activation_bytes)
from loomtrain.estimate import Collective, DryRunPlan, metered
from loomtrain.parallel.tensor_config import padded_vocab


def estimate_tensor(plan: DryRunPlan) -> None:
    """Tensor parallelism's part of the dry run (the `TensorParallel` component's hook): this
    rank's pieces of the meta model, as `apply_tensor_parallel` splits it, their activations
    and the tp collectives of a step and of the evaluation forwards."""
    from loomtrain.parallel import apply_tensor_parallel

    cfg = plan.cfg
    p, m, b = cfg.parallel, cfg.model, cfg.train.micro_batch
    plan.model, _ = apply_tensor_parallel(plan.model, plan.mesh, cfg)
    plan.activation_bytes = tensor_activation_bytes(m, b, p.tp, p.sequence_parallel,
                                                    plan.compute_bytes)
    plan.collectives += tensor_collectives(m, b, p.tp, p.sequence_parallel, cfg.accumulation_steps,
                                           plan.compute_bytes, plan.eval_forwards,
                                           cfg.run.eval_every)


def tensor_collectives(m, micro_batch: int, tp: int, sequence_parallel: bool, accumulation: int,
                       compute_bytes: int, eval_forwards: int = 0, eval_every: int = 1) -> list[Collective]:
    """The tp-axis collectives of one step of `accumulation` micro-batches, in the layout
    `loomtrain.parallel.apply_tensor_parallel` builds, then the evaluation forwards.

    GPT (vocabulary-parallel embedding, head and loss; Megatron, Shoeybi et al. section 3):
    forward: the embedding's all-reduce (S), 2 per layer after the row-parallel proj layers
    (S), the loss's 3 (max, sum of exponentials, target logit: b s fp32 each); backward: 2 per
    layer before the column-parallel qkv and fc (S), 1 before the head (S). Sequence
    parallel (Korthikanti et al., section 4.2.2): each per-layer all-reduce becomes an
    all-gather before the column layer and a reduce-scatter after the row layer (and the
    reverse in backward), the head all-gathers the sequence (reduce-scatter backward), the
    sequence split after the embedding all-gathers its gradient, and backward all-reduces the
    gradients of the 6 h-sized tensors per layer that saw one sequence chunk (2 layer norms, 2
    row biases) and of the final norm (2 h). Llama: `_llama_collectives`. MLP model (blocks'
    fc column, proj row): 1 per layer forward and 1 backward. After backward: the gradient
    norm's 4-byte all-reduce.
    """
    if tp == 1:
        return []
    b, s, h, layers, c = micro_batch, m.seq_len, m.d_model, m.n_layers, compute_bytes
    act, tokens = b * s * h * c, b * s * FP32_BYTES
    a = accumulation

    def op(purpose, name, payload, calls):
        return metered(purpose, name, "tp", tp, payload, calls)

    if m.name == "llama":
        forward, backward = _llama_collectives(m, tp, tokens, act, sequence_parallel, c, op)
    elif m.name == "mlp":
        forward = [op("MLP outputs (row-parallel proj)", "all_reduce", act, layers)]
        backward = [op("MLP input gradients (column-parallel fc)", "all_reduce", act, layers)]
    elif not sequence_parallel:
        forward = [op("embedding lookup (vocabulary-parallel)", "all_reduce", act, 1),
                   op("attention and MLP outputs (row-parallel proj)", "all_reduce", act, 2 * layers),
                   op("loss: max, sum of exp, target logit", "all_reduce", tokens, 3)]
        backward = [op("attention and MLP input gradients (column-parallel)", "all_reduce", act,
                       2 * layers),
                    op("head input gradient", "all_reduce", act, 1)]
    else:
        forward = [op("embedding lookup (vocabulary-parallel)", "all_reduce", act, 1),
                   op("sequence all-gather before qkv, fc and the head", "all_gather", act,
                      2 * layers + 1),
                   op("sequence reduce-scatter after proj", "reduce_scatter", act, 2 * layers),
                   op("loss: max, sum of exp, target logit", "all_reduce", tokens, 3)]
        backward = [op("gradient reduce-scatter (the all-gathers' backward)", "reduce_scatter",
                       act, 2 * layers + 1),
                    op("gradient all-gather (the reduce-scatters' and split's backward)",
                       "all_gather", act, 2 * layers + 1)]
        backward += [op("layer-norm and row-bias gradients (one sequence chunk each)",
                        "all_reduce", h * c, 6 * layers + 2)]
    out = [_times(x, a) for x in forward + backward]
    out.append(op("gradient norm over tp", "all_reduce", FP32_BYTES, 1))
    if eval_forwards:
        out += [_times(x, eval_forwards, eval_every, "validation ") for x in forward]
    return out


def _llama_collectives(m, tp: int, tokens: int, act: int, sequence_parallel: bool, c: int, op):
    """(forward, backward) tp collectives of one micro-batch of parallel/tensor_llama.py: as
    the GPT's, with one entry into the tensor-parallel region per block half (ln1's, shared
    by q, k and v; ln2's, shared by gate and up), except that under sequence parallelism the
    embedding reduce-scatters its lookup (all-gather backward) and the norms' weight
    gradients summed backward are ln1's and ln2's (d each) and ln_f's. Backward also sums the
    gradients of what each rank holds whole but uses a part of: q_norm's and k_norm's
    weights (head_dim each, every micro-batch), and, with the kv heads replicated (tp a
    multiple of n_kv_heads), k_proj's and v_proj's weights (and biases)."""
    layers, d = m.n_layers, m.d_model
    if not sequence_parallel:
        forward = [op("embedding lookup (vocabulary-parallel)", "all_reduce", act, 1),
                   op("attention and MLP outputs (row-parallel o_proj, down_proj)", "all_reduce",
                      act, 2 * layers),
                   op("loss: max, sum of exp, target logit", "all_reduce", tokens, 3)]
        backward = [op("attention and MLP input gradients (ln1, ln2 outputs)", "all_reduce",
                       act, 2 * layers),
                    op("head input gradient", "all_reduce", act, 1)]
    else:
        forward = [op("embedding lookup reduce-scatter (vocabulary-parallel)", "reduce_scatter",
                      act, 1),
                   op("sequence all-gather after ln1, ln2 and ln_f", "all_gather", act,
                      2 * layers + 1),
                   op("sequence reduce-scatter after o_proj, down_proj", "reduce_scatter", act,
                      2 * layers),
                   op("loss: max, sum of exp, target logit", "all_reduce", tokens, 3)]
        backward = [op("gradient reduce-scatter (the all-gathers' backward)", "reduce_scatter",
                       act, 2 * layers + 1),
                    op("gradient all-gather (the reduce-scatters' backward)", "all_gather", act,
                       2 * layers + 1),
                    op("RMSNorm weight gradients (one sequence chunk each)", "all_reduce", d * c,
                       2 * layers + 1)]
    head_dim = m.head_width
    if m.qk_norm:
        backward.append(op("q_norm and k_norm weight gradients (my heads each)", "all_reduce",
                           head_dim * c, 2 * layers))
    if m.kv_heads % tp:
        width = m.kv_heads * head_dim
        for what, size in (("weight", width * d), ("bias", width))[:1 + m.qkv_bias]:
            backward.append(op(f"replicated k_proj, v_proj {what} gradients", "all_reduce",
                               size * c, 2 * layers))
    return forward, backward


def tensor_activation_bytes(m, micro_batch: int, tp: int, sequence_parallel: bool,
                            compute_bytes: int = FP32_BYTES) -> int:
    """Bytes autograd saves in one forward of the tp-split model plus its loss, per rank
    (dropout 0; the single-process counts are loomtrain/activations.py's, tensor by tensor).

    GPT, per token and layer (c bytes): the inputs of both layer norms h each and their
    stats 4, the layer norms' outputs as the column layers keep them h each, qkv 3h/N,
    attention output h/N, fc and GELU outputs rh/N each; fp32: the attention log-sum-exp
    (heads/N). Sequence parallel keeps the layer-norm inputs and stats for s/N tokens only,
    but the column layers keep their gathered (whole-sequence) inputs: Megatron gathers again
    in backward instead, which loomtrain does not do yet. Once per token: the final norm's
    input h (h/N with sequence parallel) and stats 2 (2/N), its output as the head keeps it
    h; the vocabulary-parallel loss's exponentials (V/N, V padded to a multiple of N) and
    total (fp32), target index (int64) and 2 masks (bool), the embedding's masked index
    (int64) and mask (bool); int64 positions once per position. MLP model: per layer the
    layer norm's input, stats and output (2h + 2), fc and GELU outputs rh/N each, the rest as
    the unsplit model.
    """
    b, t, h, r, n, c = micro_batch, m.seq_len, m.d_model, m.mlp_ratio, tp, compute_bytes
    if m.name == "llama":  # split layer by layer in activations.py
        return llama_activation_bytes(m, b, c, tp, sequence_parallel)
    if m.name == "mlp":
        unsplit = mlp_activation_bytes(b, t, h, m.n_layers, r, m.vocab_size, c)
        return unsplit - c * b * t * m.n_layers * 2 * r * h * (n - 1) // n
    if sequence_parallel:
        layer = 2 * h + 2 * h / n + 4 * h / n + 2 * r * h / n + 4 / n
        once = h / n + 2 / n + h
    else:
        layer = 4 * h + 4 * h / n + 2 * r * h / n + 4
        once = 2 * h + 2
    fp32 = m.n_layers * m.n_heads / n + padded_vocab(m.vocab_size, n) / n + 1
    per_token = c * (m.n_layers * layer + once) + FP32_BYTES * fp32 + 2 * INDEX_BYTES + 3
    return round(b * t * per_token) + INDEX_BYTES * t


def _times(c: Collective, calls: int, every: int = 1, prefix: str = "") -> Collective:
    return Collective(prefix + c.purpose, c.op, c.axis, c.ranks, c.payload_bytes, c.wire_bytes,
                      every, c.calls * calls, c.algorithm, c.unit)


__all__ = ["estimate_tensor", "tensor_activation_bytes", "tensor_collectives"]
