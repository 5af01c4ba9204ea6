"""What tensor parallelism costs per rank: the collectives of one optimizer step and the
activations of one micro-batch, as pure functions of the config's numbers (the dry run prints
them, `estimate_tensor`; tests/test_dryrun.py holds them to the meter and to the tensors
autograd saves). Notation: docs/tensor.md, "Dry run".
"""

from __future__ import annotations

from loomtrain.activations import (FP32_BYTES, INDEX_BYTES, llama_activation_bytes,
                                   llama_layer_bytes, mlp_layer_bytes)
from loomtrain.estimate import Collective, DryRunPlan, metered, recomputed_microbatches
from loomtrain.models.config import padded_vocab
from loomtrain.models.moe import is_moe_layer


def estimate_tensor(plan: DryRunPlan) -> None:
    """Tensor parallelism's part of the dry run (the `TensorParallel` component's hook): this
    rank's pieces of the meta model, as `apply_tensor_parallel` splits it, their activations
    and the tp collectives of a step and of the evaluation forwards. The collectives are
    counted once every hook has run (`DryRunPlan.later`), as a pipeline keeps some layers only,
    and listed where this hook runs, in the apply order."""
    from loomtrain.parallel import apply_tensor_parallel

    cfg = plan.cfg
    p, m, b = cfg.parallel, plan.local_model, cfg.train.micro_batch
    plan.model, _ = apply_tensor_parallel(plan.model, plan.mesh, cfg)
    plan.activation_bytes = tensor_activation_bytes(m, b, p.tp, p.sequence_parallel,
                                                    plan.compute_bytes)
    at = len(plan.collectives)
    plan.later.append(lambda plan: _add_collectives(plan, at))


def _add_collectives(plan: DryRunPlan, at: int) -> None:
    cfg = plan.cfg
    p, reruns = cfg.parallel, recomputed_microbatches(plan)
    plan.collectives[at:at] = tensor_collectives(
        plan.local_model, cfg.train.micro_batch, p.tp, p.sequence_parallel,
        cfg.accumulation_steps, plan.compute_bytes, plan.eval_forwards, cfg.run.eval_every,
        plan.layers, "full" if reruns else p.recompute, p.pp > 1, reruns, p.ep)


def rerun_ops(forward: list, kind: str, recompute: str, pipelined: bool) -> list:
    """The forward ops of a layer of `kind` that run again in its backward. "full"
    recomputation reruns a pipeline stage's whole forward (parallel/pipeline/runtime.py); outside
    a pipeline each block's, under torch's checkpoint (parallel/recompute.py), which stops
    once the block's last saved tensor is back: before its last op, the collective after the
    MLP's row-parallel projection; a mixture-of-experts block ("moe") saves tensors after its
    last tp op (ln2's input, after o_proj's; the balance loss's shares, after its counts'
    all-reduce): all of them. "selective" reruns the attention core, which holds no tp
    collective."""
    if recompute != "full":
        return []
    if pipelined or kind == "moe":
        return forward
    return forward[:-1] if kind == "block" else []


def layer_counts(m, layers: list[str] | None) -> dict[str, int]:
    """How many layers of each kind ("embed", "block", "head") `layers` holds (None: the
    whole model), and how many of the blocks have a mixture of experts ("moe")."""
    if layers is None:
        layers = ["embed", *(f"blocks.{i}" for i in range(m.n_layers)), "head"]
    blocks = [int(x.split(".")[1]) for x in layers if x.startswith("blocks.")]
    moe = sum(is_moe_layer(m, i) for i in blocks) if getattr(m, "n_experts", 0) else 0
    return {"embed": layers.count("embed"), "block": len(blocks), "moe": moe,
            "head": layers.count("head")}


def tensor_collectives(m, micro_batch: int, tp: int, sequence_parallel: bool, accumulation: int,
                       compute_bytes: int, eval_forwards: int = 0, eval_every: int = 1,
                       layers: list[str] | None = None, recompute: str = "none",
                       pipelined: bool = False, reruns: int | None = None,
                       ep: int = 1) -> list[Collective]:
    """The tp-axis collectives of one step of `accumulation` micro-batches through `layers`
    (a pipeline rank's; None: the whole model), in the layout
    `loomtrain.parallel.apply_tensor_parallel` builds, then the evaluation forwards: each
    layer's forward ops once per micro-batch, and those `rerun_ops` names again
    (recomputation), its backward ops once (`_layer_ops` has them), the gradient norm's 4-byte
    all-reduce once. With a pipeline, zero-bubble's deferred weight gradients communicate
    nothing: a layer's backward ops run in its input-gradient pass. `reruns`: how many of the
    micro-batches are recomputed (None: all of them, under "full"). `ep`: the expert-parallel
    ranks the experts are split over (their weights' gradients under sequence parallelism).
    """
    if tp == 1:
        return []
    counts = layer_counts(m, layers)
    counts["block"] -= counts["moe"]  # the dense blocks
    ops = _layer_ops(m, micro_batch, tp, sequence_parallel, compute_bytes, ep)
    a = accumulation
    r = a if reruns is None else reruns
    step, forward = [], []
    for kind, n in counts.items():
        if not n:
            continue
        fwd, bwd = ops[kind]
        forward += [(x, n) for x in fwd]
        step += ([(x, n * a) for x in fwd] + [(x, n * r) for x in rerun_ops(fwd, kind, recompute, pipelined)]
                 + [(x, n * a) for x in bwd])
    out = [metered(purpose, op, "tp", tp, payload, calls)
           for (purpose, op, payload), calls in _merged(step)]
    out.append(metered("gradient norm over tp", "all_reduce", "tp", tp, FP32_BYTES))
    if eval_forwards:
        out += [metered("validation " + purpose, op, "tp", tp, payload, calls * eval_forwards,
                        every=eval_every)
                for (purpose, op, payload), calls in _merged(forward)]
    return out


def _merged(ops) -> list:
    """((purpose, op, payload), calls) pairs with the calls of equal keys summed, in order."""
    out: dict = {}
    for key, calls in ops:
        if calls:
            out[key] = out.get(key, 0) + calls
    return list(out.items())


def _layer_ops(m, micro_batch: int, tp: int, sequence_parallel: bool, c: int,
               ep: int = 1) -> dict:
    """{kind: (forward, backward)} tp ops of one micro-batch through one layer of that kind,
    each (purpose, op, payload bytes). S = b s h c, one activation.

    GPT (vocabulary-parallel embedding, head and loss; Megatron, Shoeybi et al. section 3):
    forward: the embedding's all-reduce (S), 2 per block after the row-parallel proj layers
    (S), the loss's 3 (max, sum of exponentials, target logit: b s fp32 each); backward: 2 per
    block before the column-parallel qkv and fc (S), 1 before the head (S). Sequence
    parallel (Korthikanti et al., section 4.2.2): each per-block all-reduce becomes an
    all-gather before the column layer and a reduce-scatter after the row layer (and the
    reverse in backward), the head all-gathers the sequence (reduce-scatter backward), the
    sequence split after the embedding all-gathers its gradient, and backward all-reduces the
    gradients of the 6 h-sized tensors per block that saw one sequence chunk (2 layer norms, 2
    row biases) and of the final norm (2 h). Llama: `_llama_ops`. MLP model (blocks' fc
    column, proj row): 1 per block forward and 1 backward.
    """
    b, s, h = micro_batch, m.seq_len, m.d_model
    act, tokens = b * s * h * c, b * s * FP32_BYTES
    loss = ("loss: max, sum of exp, target logit", "all_reduce", tokens)
    if m.name == "llama":
        return _llama_ops(m, tp, act, loss, sequence_parallel, c,
                          _moe_ops(m, micro_batch, sequence_parallel, c, ep))
    if m.name == "mlp":
        return {"embed": ([], []), "head": ([], []),
                "block": ([("MLP outputs (row-parallel proj)", "all_reduce", act)],
                          [("MLP input gradients (column-parallel fc)", "all_reduce", act)])}
    lookup = ("embedding lookup (vocabulary-parallel)", "all_reduce", act)
    if not sequence_parallel:
        return {"embed": ([lookup], []),
                "block": ([("attention and MLP outputs (row-parallel proj)", "all_reduce", act)] * 2,
                          [("attention and MLP input gradients (column-parallel)", "all_reduce",
                            act)] * 2),
                "head": ([loss] * 3, [("head input gradient", "all_reduce", act)])}
    gather = ("sequence all-gather before qkv, fc and the head", "all_gather", act)
    scatter = ("sequence reduce-scatter after proj", "reduce_scatter", act)
    gather_back = ("gradient reduce-scatter (the all-gathers' backward)", "reduce_scatter", act)
    scatter_back = ("gradient all-gather (the reduce-scatters' and split's backward)",
                    "all_gather", act)
    norms = ("layer-norm and row-bias gradients (one sequence chunk each)", "all_reduce", h * c)
    return {"embed": ([lookup], [scatter_back]),
            "block": ([gather, gather, scatter, scatter],
                      [gather_back, gather_back, scatter_back, scatter_back] + [norms] * 6),
            "head": ([gather] + [loss] * 3, [gather_back, norms, norms])}


def _llama_ops(m, tp: int, act: int, loss: tuple, sequence_parallel: bool, c: int,
               moe: tuple[list, list]) -> dict:
    """`_layer_ops` of parallel/tensor_llama.py: as the GPT's, with one entry into the
    tensor-parallel region per block half (ln1's, shared by q, k and v; ln2's, shared by gate
    and up), except that under sequence parallelism the embedding reduce-scatters its lookup
    (all-gather backward) and the norms' weight gradients summed backward are ln1's and ln2's
    (d each) and ln_f's. Backward also sums the gradients of what each rank holds whole but
    uses a part of: q_norm's and k_norm's weights (head_dim each, every micro-batch), and,
    with the kv heads replicated (tp a multiple of n_kv_heads), k_proj's and v_proj's weights
    (and biases). A mixture-of-experts block ("moe") has the attention half only, ln2's
    gradient under sequence parallelism, and `moe` (forward, backward): `_moe_ops`."""
    d, head_dim = m.d_model, m.head_width
    if not sequence_parallel:
        out = ("attention and MLP outputs (row-parallel o_proj, down_proj)", "all_reduce", act)
        back = ("attention and MLP input gradients (ln1, ln2 outputs)", "all_reduce", act)
        ops = {"embed": ([("embedding lookup (vocabulary-parallel)", "all_reduce", act)], []),
               "block": ([out] * 2, [back] * 2), "moe": ([out], [back]),
               "head": ([loss] * 3, [("head input gradient", "all_reduce", act)])}
    else:
        gather = ("sequence all-gather after ln1, ln2 and ln_f", "all_gather", act)
        scatter = ("sequence reduce-scatter after o_proj, down_proj", "reduce_scatter", act)
        gather_back = ("gradient reduce-scatter (the all-gathers' backward)", "reduce_scatter", act)
        scatter_back = ("gradient all-gather (the reduce-scatters' backward)", "all_gather", act)
        norms = ("RMSNorm weight gradients (one sequence chunk each)", "all_reduce", d * c)
        ops = {"embed": ([("embedding lookup reduce-scatter (vocabulary-parallel)",
                           "reduce_scatter", act)], [scatter_back]),
               "block": ([gather, gather, scatter, scatter],
                         [gather_back, gather_back, scatter_back, scatter_back, norms, norms]),
               "moe": ([gather, scatter], [gather_back, scatter_back, norms, norms]),
               "head": ([gather] + [loss] * 3, [gather_back, norms])}
    ops["moe"] = (ops["moe"][0] + moe[0], ops["moe"][1] + moe[1])
    attention = []
    if m.qk_norm:
        attention += [("q_norm and k_norm weight gradients (my heads each)", "all_reduce",
                       head_dim * c)] * 2
    if m.kv_heads % tp:
        width = m.kv_heads * head_dim
        for what, size in (("weight", width * d), ("bias", width))[:1 + m.qkv_bias]:
            attention += [(f"replicated k_proj, v_proj {what} gradients", "all_reduce",
                           size * c)] * 2
    for kind in ("block", "moe"):
        ops[kind][1].extend(attention)
    return ops


def _moe_ops(m, micro_batch: int, sequence_parallel: bool, c: int, ep: int) -> tuple[list, list]:
    """(forward, backward) tp ops of a mixture of experts (parallel/tensor_llama.py), whole
    on every tp rank: none without sequence parallelism (every rank runs the same tokens).
    With it (`SequenceParallelMoE`), forward: the balance loss's per-sequence counts summed
    (b 2E fp32); backward: each weight's gradient summed, c bytes a value: the router's (E d),
    this rank's E/ep experts' three (E/ep d h each), the shared experts' three (s d each, s =
    n_shared_experts h) and Qwen's shared gate (d)."""
    if not sequence_parallel or not getattr(m, "n_experts", 0):
        return [], []
    e, d, h = m.n_experts, m.d_model, m.expert_width
    weights = [e * d] + [e // ep * d * h] * 3 + [m.n_shared_experts * h * d] * 3 * \
        bool(m.n_shared_experts) + [d] * m.shared_expert_gate
    return ([("balance-loss counts per sequence", "all_reduce", FP32_BYTES * micro_batch * 2 * e)],
            [("mixture-of-experts weight gradients (one sequence piece each)", "all_reduce",
              n * c) for n in weights])


def tensor_activation_bytes(m, micro_batch: int, tp: int, sequence_parallel: bool,
                            compute_bytes: int = FP32_BYTES) -> int:
    """Bytes autograd saves in one forward of the tp-split model plus its loss, per rank: the
    sum of `tensor_layer_bytes` over the embedding, the blocks and the head (the llama's:
    activations.py `llama_activation_bytes`, its mixture-of-experts blocks included)."""
    if m.name == "llama":
        return llama_activation_bytes(m, micro_batch, compute_bytes, tp, sequence_parallel)
    parts = {kind: tensor_layer_bytes(m, kind, micro_batch, tp, sequence_parallel, compute_bytes)
             for kind in ("embed", "block", "head")}
    return parts["embed"] + m.n_layers * parts["block"] + parts["head"]


def tensor_layer_bytes(m, kind: str, micro_batch: int, tp: int, sequence_parallel: bool,
                       compute_bytes: int = FP32_BYTES) -> int:
    """Bytes autograd saves in one forward of one layer of the tp-split model ("embed",
    "block", "head": the loss counts with the head), per rank (dropout 0; the
    single-process counts are loomtrain/activations.py's, tensor by tensor).

    GPT, per token and block (c bytes): the inputs of both layer norms h each and their
    stats 4, the layer norms' outputs as the column layers keep them h each, qkv 3h/N,
    attention output h/N, fc and GELU outputs rh/N each; fp32: the attention log-sum-exp
    (heads/N). Sequence parallel keeps the layer-norm inputs and stats for s/N tokens only,
    but the column layers keep their gathered (whole-sequence) inputs: Megatron gathers again
    in backward instead, which loomtrain does not do yet. The head, per token: the final
    norm's input h (h/N with sequence parallel) and stats 2 (2/N), its output as the head
    keeps it h; the vocabulary-parallel loss's exponentials (V/N, V padded to a multiple of
    N) and total (fp32), target index (int64) and 2 masks (bool). The embedding: its masked
    index (int64) and mask (bool) per token, int64 positions once per position. MLP model: per block the layer norm's
    input, stats and output (2h + 2), fc and GELU outputs rh/N each, the rest as the unsplit
    model. The llama: activations.py `llama_layer_bytes`.
    """
    b, t, h, r, n, c = micro_batch, m.seq_len, m.d_model, m.mlp_ratio, tp, compute_bytes
    if m.name == "llama":
        return llama_layer_bytes(kind, b, t, m, c, tp, sequence_parallel)
    if m.name == "mlp":
        unsplit = mlp_layer_bytes(kind, b, t, h, r, m.vocab_size, c)
        return unsplit - (c * b * t * 2 * r * h * (n - 1) // n if kind == "block" else 0)
    if kind == "embed":
        return b * t * (INDEX_BYTES + 1) + INDEX_BYTES * t
    if kind == "head":
        once = h / n + 2 / n + h if sequence_parallel else 2 * h + 2
        vocab = padded_vocab(m.vocab_size, n) / n
        return round(b * t * (c * once + FP32_BYTES * (vocab + 1) + INDEX_BYTES + 2))
    if sequence_parallel:
        layer = 2 * h + 2 * h / n + 4 * h / n + 2 * r * h / n + 4 / n
    else:
        layer = 4 * h + 4 * h / n + 2 * r * h / n + 4
    return round(b * t * (c * layer + FP32_BYTES * m.n_heads / n))


__all__ = ["estimate_tensor", "tensor_activation_bytes", "tensor_collectives",
           "tensor_layer_bytes"]
