"""ZeRO's pure parts: flat layout, slices, checkpoint boxes, unit discovery, memory formulas."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn as nn

from loomtrain.models import GPT, MLP
from loomtrain.parallel.zero import ROOT, assign_parameters, find_units
from loomtrain.parallel.zero.layout import flat_range_boxes, unit_layout, zero_memory


def test_layout_pads_to_a_multiple_and_slices_cover_every_parameter_once():
    layout = unit_layout("u", [("a", (3, 5)), ("b", (7,)), ("c", ())], multiple=4)
    assert layout.numel == 23 and layout.padded == 24
    assert [s.offset for s in layout.slots] == [0, 15, 22]
    covered = []
    for i in range(4):
        lo, hi = layout.range(i, 4)
        assert hi - lo == 6
        for piece in layout.slices(lo, hi):
            assert lo <= piece.unit_offset and piece.unit_offset + piece.numel <= hi
            covered += [(piece.slot.name, k) for k in range(piece.start, piece.stop)]
    assert sorted(covered) == sorted((s.name, k) for s in layout.slots for k in range(s.numel))


@pytest.mark.parametrize("seed", range(20))
def test_boxes_tile_a_flat_range_in_memory_order(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
    n = math.prod(shape)
    start = rng.randrange(n)
    stop = rng.randint(start + 1, n)
    full = torch.arange(n).view(shape)
    flat = []
    for offsets, sizes in flat_range_boxes(shape, start, stop):
        box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert _contiguous_in(box)  # one view of the shard's flat buffer
        flat += box.reshape(-1).tolist()
    assert flat == list(range(start, stop))  # exactly the range, in order, no overlap


def _contiguous_in(box) -> bool:
    """The box's values (flat indices into an arange) are consecutive: it is one run of memory."""
    values = box.reshape(-1)
    return bool((values[1:] - values[:-1] == 1).all())


def test_a_matrix_range_is_at_most_three_boxes():
    assert flat_range_boxes((4, 10), 13, 37) == [((1, 3), (1, 7)), ((2, 0), (1, 10)), ((3, 0), (1, 7))]
    assert flat_range_boxes((4, 10), 10, 30) == [((1, 0), (2, 10))]
    assert flat_range_boxes((), 0, 1) == [((), ())]


def test_default_units_are_the_blocks_and_tied_weights_go_to_the_root():
    model = GPT(50, 8, 16, 3, 2)
    units = find_units(model)
    assert [name for name, _ in units] == ["blocks.0", "blocks.1", "blocks.2"]
    owners = assign_parameters(model, units)
    root = [name for name, _ in owners[ROOT]]
    # the output head is the token embedding: reachable from outside every unit, so root,
    # under its first name only
    assert root == ["tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"]
    assert [n for n, _ in owners["blocks.1"]][0] == "blocks.1.ln1.weight"
    assert sum(len(v) for v in owners.values()) == len(list(model.parameters()))


def test_units_by_pattern_and_a_parameter_shared_by_two_units():
    model = MLP(20, 8, 3)
    model.blocks[2].fc.weight = model.blocks[0].fc.weight  # shared by units 0 and 2
    units = find_units(model, ["blocks.[02]"])
    assert [name for name, _ in units] == ["blocks.0", "blocks.2"]
    owners = assign_parameters(model, units)
    assert "blocks.0.fc.weight" in [n for n, _ in owners[ROOT]]
    assert "blocks.1.fc.weight" in [n for n, _ in owners[ROOT]]  # not a unit: root
    with pytest.raises(ValueError, match="no module of the model matches"):
        find_units(model, ["layers.*"])


def test_frozen_parameters_are_left_out():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    owners = assign_parameters(model, [])
    assert [n for n, _ in owners[ROOT]] == ["0.bias", "1.weight", "1.bias"]


def test_memory_formulas_of_the_zero_paper():
    """fp32 AdamW, P parameters, N ranks: 16P, 8P + 8P/N, 4P + 12P/N, 16P/N (ZeRO, arXiv
    1910.02054, figure 1, with fp32 instead of fp16 parameters and gradients)."""
    P, N = 1200, 4
    stage = {s: zero_memory([P], s, N, N, states=2).total_bytes for s in (1, 2, 3)}
    assert zero_memory([P], 1, 1, 1, states=2).total_bytes == 16 * P
    assert stage == {1: 8 * P + 8 * P // N, 2: 4 * P + 12 * P // N, 3: 16 * P // N}
    bf16 = zero_memory([P], 3, N, N, states=2, compute_bytes=2, separate_master=True)
    assert (bf16.parameter_bytes, bf16.gradient_bytes, bf16.optimizer_bytes) == (2 * P // N, 4 * P // N, 12 * P // N)
    # hierarchical: parameters over the node's L ranks, optimizer over all L x C
    hier = zero_memory([P], 3, 2, 4, states=2)
    assert (hier.parameter_bytes, hier.gradient_bytes, hier.optimizer_bytes) == (4 * P // 2, 4 * P // 4, 8 * P // 4)
