"""LASP (parallel/sequence/lasp.py): linear attention over a sequence split in contiguous
chunks over the `cp` ranks, against the single-process quadratic reference; its traffic per
layer does not grow with the sequence."""

from __future__ import annotations

import pytest
import torch

from harness import run_world
from loomtrain import comm
from loomtrain.mesh import build_mesh
from loomtrain.models import GPT, token_loss_sum
from loomtrain.models.linear_attention import (causal_linear_attention, default_decay,
                                               feature_map, naive_linear_attention)
from loomtrain.parallel.sequence.context import Ring, SeqContext
from loomtrain.parallel.sequence.lasp import carry_weights, lasp_attention

B, H, T, D = 2, 2, 32, 8
# chunk edges at 16 (world 2) and 8, 16, 24 (world 4). Row 0: starts at 5 (inside the first
# chunk) and 16 (exactly at an edge). Row 1: starts at 6 and 22, both inside chunks; its
# document 1 covers positions 6-21, three chunks at world 4 (members 0, 1 and 2).
DOCS = torch.tensor([[0] * 5 + [1] * 11 + [2] * 16, [0] * 6 + [1] * 16 + [2] * 10])


def _relative(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    return float((got - want).abs().max() / scale.abs().max())


def _parity(ring: Ring) -> list[float]:
    """Worst relative error of the output and of the q, k, v gradients, for every case."""
    g = torch.Generator().manual_seed(0)
    q, k = (feature_map(torch.randn(B, H, T, D, generator=g)) for _ in range(2))
    v, upstream = (torch.randn(B, H, T, D, generator=g) for _ in range(2))
    worst = []
    for decay in (None, default_decay(H)):
        for docs in (None, DOCS):
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            reference = naive_linear_attention(*full, decay, docs)
            reference.backward(upstream)
            ctx = SeqContext.of_ring(ring, T, "contiguous", docs)
            mine = ctx.local_positions
            local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
            # chunk=5: the local kernel's chunks do not divide the ranks' chunks either
            out = lasp_attention(*local, ctx, decay, chunk=5)
            out.backward(upstream[:, :, mine])
            errors = [_relative(out.detach(), reference.detach()[:, :, mine], reference.detach())]
            errors += [_relative(x.grad, f.grad[:, :, mine], f.grad) for x, f in zip(local, full)]
            worst.append(max(errors))
    return worst


def _bytes_per_layer(ring: Ring, seq_len: int) -> tuple[dict, dict, int]:
    """Wire bytes of one layer's forward and backward at b = h = 1, d = 8."""
    mesh = ring.mesh
    ctx = SeqContext.of_ring(ring, seq_len, "contiguous")
    t = seq_len // ring.size
    g = torch.Generator().manual_seed(1)
    q, k = (feature_map(torch.randn(1, 1, t, 8, generator=g)).requires_grad_() for _ in range(2))
    v = torch.randn(1, 1, t, 8, generator=g, requires_grad=True)
    mesh.meter.take()
    gathered_before = mesh.meter.total("payload_bytes", "all_gather", "cp")
    out = lasp_attention(q, k, v, ctx, default_decay(1), chunk=256)
    forward = mesh.meter.take()
    gathered = mesh.meter.total("payload_bytes", "all_gather", "cp") - gathered_before
    out.sum().backward()
    return forward, mesh.meter.take(), gathered


def _gpt_parity(ring: Ring) -> float:
    """A linear-attention GPT with LASP installed in its `core` hooks, each rank holding its
    chunk of the tokens, against the whole GPT: logits and summed gradients."""
    torch.manual_seed(0)
    model = GPT(32, T, 16, 2, 2, attention="linear", linear_decay=True)
    x = torch.randint(0, 32, (B, T + 1), generator=torch.Generator().manual_seed(3))
    reference = model(x[:, :-1])
    token_loss_sum(reference, x[:, 1:]).backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    ctx = SeqContext.of_ring(ring, T, "contiguous")
    mine = ctx.local_positions
    model.position_ids = mine
    for block in model.blocks:
        block.attn.core = lambda q, k, v, attn=block.attn: lasp_attention(q, k, v, ctx, attn.decay)
    logits = model(x[:, :-1][:, mine])
    token_loss_sum(logits, x[:, 1:][:, mine]).backward()
    errors = [_relative(logits.detach(), reference.detach()[:, mine], reference.detach())]
    for name, p in model.named_parameters():
        comm.all_reduce(p.grad, ring.mesh, "cp")  # each rank's loss covers its tokens only
        errors.append(_relative(p.grad, want[name], want[name]))
    return max(errors)


def _world(rank, world):
    ring = Ring(build_mesh({"cp": world}), "cp")
    parity = _parity(ring)
    traffic = [_bytes_per_layer(ring, seq_len) for seq_len in (1024, 16384)]
    gpt = _gpt_parity(ring) if world == 2 else 0.0
    return parity, traffic, gpt


@pytest.mark.parametrize("world", [2, 4])
def test_lasp_matches_the_single_device_reference(world):
    state_bytes = 1 * 1 * 8 * (8 + 1) * 4  # b * h * d * (d_v + 1) fp32 numbers
    for parity, traffic, gpt in run_world(_world, world, timeout_s=60):
        # fp32 throughout; the ranks regroup the same <= 32 positive-weighted terms (states
        # summed per chunk, then across ranks), a few ulps apart, ~1e-7 relative; 1e-4 leaves
        # room for the division by the denominator and the backward's extra products
        assert max(parity) < 1e-4, parity
        assert gpt < 1e-4, gpt
        (fwd_short, bwd_short, _), (fwd_long, bwd_long, payload) = traffic
        assert fwd_short == fwd_long and bwd_short == bwd_long
        # forward: an all-gather of N states, each rank sends N-1 of them; backward: the
        # reduce-scatter of their N gradients, which gloo runs as an all-reduce (2(N-1)/N x S)
        assert fwd_long == {"all_gather": (world - 1) * state_bytes,
                            "total": (world - 1) * state_bytes}
        assert bwd_long == {"reduce_scatter": 2 * (world - 1) * state_bytes,
                            "total": 2 * (world - 1) * state_bytes}
        assert comm.choose_impl("reduce_scatter", world * state_bytes, world) == "native"
        assert payload == world * state_bytes  # the gathered states


def test_without_a_ring_lasp_is_the_local_kernel():
    g = torch.Generator().manual_seed(4)
    q, k = (feature_map(torch.randn(B, H, T, D, generator=g)) for _ in range(2))
    v = torch.randn(B, H, T, D, generator=g)
    decay = default_decay(H)
    got = lasp_attention(q, k, v, SeqContext.local(T, DOCS), decay, chunk=7)
    assert torch.equal(got, causal_linear_attention(q, k, v, decay, DOCS, chunk=7))


def test_carry_weights_decay_over_gaps_and_stop_at_documents():
    log_decay = torch.tensor([0.0, -1.0], dtype=torch.float64)
    resets = torch.tensor([[False, False, False, False], [False, True, False, False]])
    w = carry_weights([2, 3, 4, 5], resets, log_decay, me=3)
    # member 3 reads member 2 at once, member 1 across member 2's 4 tokens, member 0 across
    # 3 + 4; in row 1 member 1 starts a document, so member 0 is cut off
    gaps = torch.tensor([7.0, 4.0, 0.0, 0.0], dtype=torch.float64)
    assert torch.equal(w[0, 0], torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(w[0, 1], torch.exp(-gaps) * torch.tensor([1, 1, 1, 0]))
    assert torch.allclose(w[1, 1], torch.exp(-gaps) * torch.tensor([0, 1, 1, 0]))
    assert torch.equal(carry_weights([2, 3], resets[:, :2], log_decay, me=0), torch.zeros(2, 2, 2))
