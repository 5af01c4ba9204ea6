"""Streaming DiLoCo (lowcomm/streaming.py): the fragments (pure), the schedule as the
all-reduces really ran, DiLoCo as its F = 1 limit, the overlap, int8 bytes, resume, and the
config rules.

One spawn, world 2, runs every training case through the trainer's loop; `_traced_runs`
keeps each run's wrapper and records every pseudo-gradient reduce it starts."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import tiny_tree
from harness import run_world
from loomtrain.comm.quantized import quantized_wire_ratio
from loomtrain.errors import ConfigError
from loomtrain.lowcomm.streaming import split_fragments, sync_offsets
from loomtrain.models import build_model
from loomtrain.models.config import ModelConfig
from loomtrain.train.config import config_from_dict
from test_lowcomm import _losses, _rel, _runs

LATENCY_MS = 60  # the simulated link of the overlap case: every cross-node op takes >= this


def _traced_runs(rank, world, jobs, root):
    """test_lowcomm._runs, instrumented in this process only: every StreamingDiLoCo the
    builder makes is kept, every asynchronous (pseudo-gradient) reduce is recorded with the
    step and size, and so is the time each optimizer step ended. Every rank returns (rank 0:
    _runs' records, else None; one trace per streaming run, in job order)."""
    from loomtrain import comm
    from loomtrain.lowcomm import streaming

    wrappers, reduces, step_ends = [], [], []
    build = streaming.build

    def keep(*args):
        model, optimizer = build(*args)
        wrappers.append(model)
        reduces.append([])
        step_ends.append({})
        after_step = model.after_step

        def timed(step, last=False):
            step_ends[-1][step] = time.perf_counter()
            return after_step(step, last)
        model.after_step = timed
        return model, optimizer

    def recorded(reduce):
        def call(tensor, mesh, axis, *args, async_op=False, **kwargs):
            if async_op and wrappers:
                reduces[-1].append((wrappers[-1].step, tensor.numel()))
            return reduce(tensor, mesh, axis, *args, async_op=async_op, **kwargs)
        return call

    streaming.build = keep
    comm.all_reduce = recorded(comm.all_reduce)
    comm.quantized_all_reduce = recorded(comm.quantized_all_reduce)
    out = _runs(rank, world, jobs, root)
    traces = [{"numels": [sum(p.numel() for p in ps) for ps in w.fragment_params],
               "index": w.fragment_index, "params": len(w.params), "offsets": w.offsets,
               "sync_log": w.sync_log, "reduces": r, "step_ends": e,
               "final": torch.cat([p.detach().reshape(-1) for p in w.params])}
              for w, r, e in zip(wrappers, reduces, step_ends)]
    return out, traces


# --- pure: the fragments --------------------------------------------------------------------

def test_fragments_are_strided_whole_blocks_and_cover_every_parameter_once():
    for name, layers in (("gpt", 4), ("gpt", 3), ("mlp", 5)):
        model = build_model(ModelConfig(name=name, n_layers=layers, d_model=16, n_heads=2))
        names = [n for n, _ in model.named_parameters()]  # the tied head once, as tok_emb
        for fragments in range(1, layers + 1):
            split = split_fragments(names, fragments)
            assert sorted(i for f in split for i in f) == list(range(len(names)))  # exactly once
            for p, indices in enumerate(split):
                blocks = {int(names[i].split(".")[1]) for i in indices
                          if names[i].startswith("blocks.")}
                assert blocks == set(range(p, layers, fragments))  # block i -> fragment i % F
        split = split_fragments(names, 2)
        assert names.index("tok_emb.weight") in split[0]  # before any block: fragment 0
        assert names.index("ln_f.weight") in split[(layers - 1) % 2]  # with the last block
        if name == "mlp":  # an untied head too
            assert names.index("head.weight") in split[(layers - 1) % 2]
        with pytest.raises(ValueError, match=f"this model has {layers}"):
            split_fragments(names, layers + 1)
    assert sync_offsets(12, 3) == [0, 4, 8]


# --- world 2: everything that trains -----------------------------------------------------------

def test_world2_schedule_diloco_limit_overlap_int8_and_resume(tmp_path, corpus):
    def tree(lowcomm, **sections):
        sections.setdefault("train", {}).setdefault("steps", 16)
        return tiny_tree(tmp_path, corpus, parallel={"nproc": 2, **sections.pop("parallel", {})},
                         lowcomm=lowcomm, **sections)

    streaming = {"algorithm": "streaming_diloco", "inner_steps": 4}
    f2 = {**streaming, "fragments": 2, "overlap_steps": 1}
    # the overlap case: each rank its own node, a link of LATENCY_MS per op (bandwidth ample)
    link = dict(parallel={"ranks_per_node": 1}, train={"steps": 8},
                comm={"inter_node_gbps": 100.0, "inter_node_latency_ms": LATENCY_MS})
    # resume: dropout on (each rank's RNG matters), checkpoints every 4 steps, where fragment
    # 0's sync has just been launched and is in flight (tau = 1)
    resumed = dict(model={"dropout": 0.1}, train={"steps": 12}, checkpoint={"every": 4})
    jobs = [("diloco", tree({"algorithm": "diloco", "inner_steps": 4}), None, False),
            ("f1", tree({**streaming, "overlap_steps": 0}), None, False),
            ("f2", tree(f2), None, False),
            ("int8", tree({**f2, "quantize": "int8"}), None, False),
            ("tau0", tree({**f2, "overlap_steps": 0}, **link), None, False),
            ("tau1", tree(f2, **link), None, False),
            ("r", tree(f2, **resumed), None, False),
            ("r_stopped", tree(f2, **resumed), 4, False),  # stops after step 4, a checkpoint
            ("r_stopped", tree(f2, **resumed), None, True),
            ("r_mid", tree(f2, **resumed), 6, False),  # after step 6: fragment 1 in flight
            ("r_mid", tree(f2, **resumed), None, True)]
    ranks = run_world(_traced_runs, 2, jobs, str(tmp_path / "w2"), timeout_s=300)
    out = ranks[0][0]
    names = [name for name, *_ in jobs if name != "diloco"]  # the streaming runs, in order
    traces = {}
    for i, name in enumerate(names):  # a resumed run's trace replaces its first part's
        traces[name] = ranks[0][1][i]
        # (every run) the run ends on one model: the replicas' parameters bit for bit
        assert torch.equal(ranks[0][1][i]["final"], ranks[1][1][i]["final"]), name

    # (b) F = 1, tau = 0 is DiLoCo (H = 4, outer Nesterov): the same operations in the same
    # order. Measured: equal bit for bit (0.0 relative; 5.48 -> 3.87); 1e-6 the bound, as in
    # test_lowcomm's parities, so a reordering of the same sums would still pass
    diloco, f1 = _losses(out["diloco"][0]), _losses(out["f1"][0])
    assert diloco[-1] < diloco[0] - 0.3
    assert _rel(f1, diloco) < 1e-6, (f1, diloco)

    # (a) the schedule as the all-reduces ran: F = 2, H = 4 over 4 periods of 16 steps.
    # Fragment 1 (offset 2) at steps 2, 6, 10, 14, fragment 0 at 4, 8, 12, 16; each reduce
    # covers exactly its fragment's parameters; the two fragments partition the model
    t = traces["f2"]
    assert t["offsets"] == [0, 2]
    assert sorted(i for f in t["index"] for i in f) == list(range(t["params"]))
    launched = {s["launched_step"]: s["fragment"] for s in t["sync_log"]}
    assert launched == {2: 1, 4: 0, 6: 1, 8: 0, 10: 1, 12: 0, 14: 1, 16: 0}
    assert [step for step, _ in t["reduces"]] == sorted(launched)  # one reduce per launch
    for period in range(4):
        window = [(launched[s], numel) for s, numel in t["reduces"]
                  if 4 * period < s <= 4 * period + 4]
        assert sorted(f for f, _ in window) == [0, 1]  # every fragment exactly once
        assert all(numel == t["numels"][f] for f, numel in window)  # and all of its parameters
    # each lands tau = 1 step after its launch; the last (step 16) at the run's end
    assert all(s["landed_step"] == min(s["launched_step"] + 1, 16) for s in t["sync_log"])
    f2_losses = _losses(out["f2"][0])
    assert f2_losses[-1] < f2_losses[0] - 0.3, f2_losses  # it learns: measured 5.48 -> 4.26
    in_flight = [r["fragments_in_flight"] for r in out["f2"][0]]
    assert in_flight == [0, 1, 0, 1] * 3 + [0, 1, 0, 0]  # the last step ends on one model

    # (c) in flight across an inner step: with tau = 1 every sync is launched at step s, and
    # the whole of step s + 1 (its forward, backward and optimizer step, and the trainer's own
    # all-reduces, which pay the link's latency too) runs before its wait begins, 133-147 ms
    # later (measured); by then the sync's simulated LATENCY_MS have passed, so the wait
    # blocks ~0 (measured 20-27 us). With tau = 0 the same syncs block the replica for the
    # latency (measured 59.6-60.7 ms each). Summed over the run (outer_wait_s), tau = 1 still
    # blocks once, at the run's end, for the sync of step 8: measured 0.059 s against 0.240 s
    latency = LATENCY_MS / 1e3
    tau1 = [s for s in traces["tau1"]["sync_log"] if s["landed_step"] > s["launched_step"]]
    assert len(tau1) == 3  # steps 2, 4, 6; the one of step 8 lands at the run's end
    ends = traces["tau1"]["step_ends"]
    for s in tau1:
        assert s["launched_s"] < ends[s["launched_step"] + 1] <= s["wait_s"]
        assert s["landed_s"] - s["wait_s"] < 0.5 * latency, s
    tau0 = traces["tau0"]["sync_log"]
    assert len(tau0) == 4 and all(s["landed_s"] - s["wait_s"] > 0.9 * latency for s in tau0), tau0
    blocked = {name: sum(r["outer_wait_s"] for r in out[name][0]) for name in ("tau0", "tau1")}
    assert blocked["tau1"] < blocked["tau0"] / 2, blocked

    # (d) int8: the wire bytes of the pseudo-gradients against fp32's, same schedule. At
    # world 2 quantized_wire_ratio is 2 (1 + 4/64) / 8 = 0.2656; padding each fragment to
    # whole chunks of 64 adds a little: measured 0.26612 (147,696 bytes against 555,008)
    wire = {name: sum(r["pseudo_gradient_wire_bytes"] for r in out[name][0])
            for name in ("f2", "int8")}
    ratio = wire["int8"] / wire["f2"]
    assert quantized_wire_ratio(2) <= ratio < quantized_wire_ratio(2) * 1.01, (ratio, wire)
    int8 = _losses(out["int8"][0])
    assert int8[-1] < int8[0] - 0.3, int8  # it learns
    # the int8 rounding barely moves the run: final losses 4.2599 and 4.2599 (1e-5 relative)
    assert abs(int8[-1] - f2_losses[-1]) < 0.01 * f2_losses[-1], (int8, f2_losses)

    # (e) resume at a checkpoint with a sync in flight: bitwise the unstopped run
    reference = _losses(out["r"][0])
    records, saved = out["r_stopped"]
    assert saved == ["step_00000008", "step_00000012"]
    assert _losses(records) == reference  # == on floats
    # a stop between checkpoints lands the sync in flight, averages, saves, and resumes from
    # there: the same until the stop, then its own run (an extra average at step 6)
    losses = _losses(out["r_mid"][0])
    assert losses[:6] == reference[:6] and losses[6:] != reference[6:]
    assert losses[-1] < losses[0] - 0.3


# --- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("lowcomm,why", [
    ({"fragments": 3, "inner_steps": 6, "overlap_steps": 0},
     "lowcomm.fragments=3 is more than the model's model.n_layers=2"),
    ({"fragments": 2, "inner_steps": 5, "overlap_steps": 0}, "set lowcomm.inner_steps=6"),
    ({"fragments": 2, "inner_steps": 4, "overlap_steps": 2},
     "lowcomm.overlap_steps=2 must be less than lowcomm.inner_steps / lowcomm.fragments = 4/2 = 2"),
    ({"inner_steps": 1}, "set lowcomm.overlap_steps to at most 0"),  # the default tau = 1
    ({"inner_steps": 4, "mix": 1.0}, "less than 1"),
    ({"inner_steps": 4, "outer_optimizer": "sgd", "outer_momentum": 0.5},
     'outer_optimizer="sgd" has none'),
])
def test_config_refuses_a_schedule_that_does_not_fit(tmp_path, corpus, lowcomm, why):
    with pytest.raises(ConfigError, match="lowcomm") as err:
        config_from_dict(tiny_tree(tmp_path, corpus,
                                   lowcomm={"algorithm": "streaming_diloco", **lowcomm}))
    assert why in str(err.value), str(err.value)


def test_config_mix_belongs_to_streaming_and_the_keys_are_accepted(tmp_path, corpus):
    with pytest.raises(ConfigError, match="lowcomm.mix is not read by lowcomm.algorithm='diloco'"):
        config_from_dict(tiny_tree(tmp_path, corpus, lowcomm={"algorithm": "diloco", "mix": 0.2}))
    lowcomm = {"algorithm": "streaming_diloco", "inner_steps": 8, "fragments": 2,
               "overlap_steps": 3, "quantize": "int8", "mix": 0.0, "outer_lr": 0.5}
    cfg = config_from_dict(tiny_tree(tmp_path, corpus, lowcomm=lowcomm, checkpoint={"every": 16},
                                     parallel={"nproc": 2}))
    assert cfg.lowcomm.model_dump() | lowcomm == cfg.lowcomm.model_dump()
    assert config_from_dict({}).lowcomm.mix == 0.5  # the paper's alpha
