"""What context parallelism sends per rank, for `loom train --dry-run` (`estimate_context`):
the cp-axis collectives of one step, per block and micro-batch, of the ring (ring.py),
Ulysses (ulysses.py) and LASP (lasp.py, lasp_comm.py). Activations need nothing of their own:
every estimate counts a rank's seq_len / cp tokens of each row (`DryRunPlan.local_model`).
Formulas: docs/dry-run.md, "Context parallelism".
"""

from __future__ import annotations

from loomtrain.activations import FP32_BYTES, llama_heads
from loomtrain.comm.meter import wire_bytes
from loomtrain.errors import ConfigError
from loomtrain.estimate import Collective, DryRunPlan, metered, recomputed_microbatches
from loomtrain.parallel.sequence import resolve_method, staged_kernel
from loomtrain.parallel.tensor_estimate import layer_counts


def estimate_context(plan: DryRunPlan) -> None:
    """The `Context` component's hook: the cp collectives of the blocks this rank runs (a
    pipeline rank's, `plan.layers`), for every micro-batch of a step and every evaluation
    forward. cp_method="auto" runs the kernel its plan chooses."""
    cfg = plan.cfg
    p = cfg.parallel
    if p.cp == 1:
        return  # packing alone changes no estimate
    method = resolve_method(cfg)
    if method == "auto":
        method = _traced_kernel(cfg)
    blocks = layer_counts(cfg.model, plan.layers)["block"]
    forward, backward = block_collectives(plan.local_model, cfg.train.micro_batch, p.cp, p.tp,
                                          method, plan.compute_bytes)
    a = cfg.accumulation_steps
    # a recomputed micro-batch reruns the attention (full recomputation, a planned schedule's)
    forwards = a + recomputed_microbatches(plan)
    plan.collectives += [_times(x, blocks * forwards) for x in forward]
    plan.collectives += [_times(x, blocks * a) for x in backward]
    plan.eval_collectives += [_times(x, blocks * plan.eval_forwards, cfg.run.eval_every,
                                     "validation ") for x in forward if plan.eval_forwards]


def _traced_kernel(cfg) -> str:
    """The kernel cp_method="auto" chooses without a pipeline, where it rewrites the traced
    model: every GPT attention call has the same heads, so the plan's choice is the staged
    one. A budget may make it checkpoint blocks, decided from traced shapes: refused."""
    if cfg.parallel.activation_budget_mb is not None:
        raise ConfigError('loom train --dry-run does not model parallel.cp_method="auto" with '
                          "parallel.activation_budget_mb (whether it checkpoints the blocks "
                          "comes from tracing the model): run without --dry-run, or leave the "
                          "budget unset")
    return staged_kernel(cfg)


def block_collectives(m, micro_batch: int, cp: int, tp: int, method: str,
                      c: int) -> tuple[list[Collective], list[Collective]]:
    """(forward, backward) cp collectives of one block's attention for one micro-batch, `m`
    with the seq_len of one rank (t = T / cp), h and k the query and kv heads of one of `tp`
    ranks, e a head's width; one tensor of the kv heads X = c b k t e:

    - ring: forward, N - 1 steps each sending k and v on (2 (N - 1) sends of X, grouped kv
      heads unrepeated); backward, k and v again (2 (N - 1) of X) and the fp32 accumulators
      of their gradients (2 (N - 1) of 4 b k t e);
    - Ulysses: forward, one all-to-all of q, k and v stacked (3 c b h t e; when the kv heads
      do not split over cp they are repeated to h; when they split and are fewer, q alone
      (c b h t e) and k, v stacked (2X)), one of the output (c b h t e); backward, the same
      exchanges of the gradients;
    - LASP: forward, the all-gather of every member's state (b, h, e, e + 1), N of them;
      backward, its adjoint reduce-scatter of the same N states' gradients.
    """
    b, t = micro_batch, m.seq_len
    heads, kv, e = llama_heads(m, tp)
    if method == "ring":
        x = c * b * kv * t * e
        sends = [_send("ring: k and v blocks", cp, x, 2 * (cp - 1))]
        grads = [_send("ring: k and v gradient accumulators (fp32)", cp, FP32_BYTES * b * kv * t * e,
                       2 * (cp - 1))]
        return sends, sends + grads
    if method == "ulysses":
        q = c * b * heads * t * e
        if kv % cp:
            kv = heads
        exchanges = [("q, k and v", 3 * q, 1)] if kv == heads else \
            [("q", q, 1), ("k and v (kv heads)", 2 * c * b * kv * t * e, 1)]
        exchanges.append(("attention output", q, 1))
        forward = [_all_to_all(f"Ulysses: {what}", cp, payload) for what, payload, _ in exchanges]
        backward = [_all_to_all(f"Ulysses: gradient of {what}", cp, payload)
                    for what, payload, _ in exchanges]
        return forward, backward
    assert method == "lasp", method
    states = cp * c * b * heads * e * (e + 1)
    return ([metered("LASP: every member's state", "all_gather", "cp", cp, states)],
            [metered("LASP: the states' gradients", "reduce_scatter", "cp", cp, states)])


def _send(purpose: str, cp: int, payload: int, calls: int) -> Collective:
    return Collective(purpose, "send", "cp", cp, payload, wire_bytes("send", payload, cp), 1,
                      calls, "send")


def _all_to_all(purpose: str, cp: int, payload: int) -> Collective:
    return Collective(purpose, "all_to_all", "cp", cp, payload,
                      wire_bytes("all_to_all", payload, cp), 1, 1, "all_to_all")


def _times(x: Collective, calls: int, every: int = 1, prefix: str = "") -> Collective:
    return Collective(prefix + x.purpose, x.op, x.axis, x.ranks, x.payload_bytes, x.wire_bytes,
                      every, x.calls * calls, x.algorithm, x.unit)
