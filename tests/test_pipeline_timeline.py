"""The pipeline timeline: its file, the measured bubble, and `loom report`'s Gantt chart of it."""

from __future__ import annotations

import json

import pytest

from loomtrain.cli import main
from loomtrain.gantt import _microbatch, pipeline_summary
from loomtrain.timeline import (TimelineError, measured_bubble, read_pipeline_timeline,
                                write_pipeline_timeline)

PNG = b"\x89PNG\r\n\x1a\n"


def _span(lane, kind, name, start_s, end_s):
    return {"lane": lane, "kind": kind, "name": name, "start_s": start_s, "end_s": end_s}


# Seconds. The forward/backward phase is [0, 4] on 2 ranks (8 rank-seconds), of which F and B
# fill 1 + 1.25 + 0.75 + 0.5 = 3.5: the bubble is 4.5 / 8 exactly (all binary fractions). The
# waits, the optimizer step and the gradient sync are not work.
TWO_RANKS = [
    {"rank": 0, "spans": [_span("compute", "F", "F0.0", 0.0, 1.0), _span("comm", "SEND_F", "SEND_F0.0", 1.0, 1.25),
                          _span("compute", "WAIT", "WAIT RECV_B0.0", 1.0, 2.75),
                          _span("comm", "RECV_B", "RECV_B0.0", 1.0, 2.75), _span("compute", "B", "B0.0", 2.75, 4.0),
                          _span("compute", "OPT", "OPT", 4.0, 5.0)]},
    {"rank": 1, "spans": [_span("comm", "RECV_F", "RECV_F0.1", 0.0, 1.25), _span("compute", "WAIT", "WAIT RECV_F0.1", 0.0, 1.25),
                          _span("compute", "F", "F0.1", 1.25, 2.0), _span("compute", "B", "B0.1", 2.0, 2.5),
                          _span("copy", "OFFLOAD", "OFFLOAD0.1", 2.0, 2.25), _span("comm", "SEND_B", "SEND_B0.1", 2.5, 2.75),
                          _span("compute", "SYNC", "SYNC", 2.5, 3.0)]},
]


def test_measured_bubble_of_hand_made_spans_is_exact():
    assert measured_bubble(TWO_RANKS) == 0.5625
    one = [{"rank": 0, "spans": [_span("compute", "F", "F0.0", 0.0, 1.0), _span("compute", "W", "W0.0", 1.0, 2.0),
                                 _span("compute", "I", "I0.0", 3.0, 4.0)]}]
    assert measured_bubble(one) == 0.25  # idle [2, 3] of [0, 4]
    assert measured_bubble(TWO_RANKS + [{"rank": 2, "spans": []}]) == 1 - 3.5 / 12  # an idle rank counts
    nothing = [{"rank": 0, "spans": [_span("compute", "OPT", "OPT", 0.0, 1.0)]}]
    assert measured_bubble(nothing) != measured_bubble(nothing)  # NaN: no forward or backward ran


def _orders(schedule: str, pp: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """Each rank's (kind, microbatch) in execution order: GPipe (all forwards, then all
    backwards) or 1F1B (pp - 1 - rank warm-up forwards, then one forward one backward)."""
    orders = []
    for rank in range(pp):
        fs, bs = [("F", j) for j in range(microbatches)], [("B", j) for j in range(microbatches)]
        if schedule == "gpipe":
            orders.append(fs + bs)
            continue
        warmup = min(pp - 1 - rank, microbatches)
        steady = [a for pair in zip(fs[warmup:], bs) for a in pair]
        orders.append(fs[:warmup] + steady + bs[microbatches - warmup:])
    return orders


def simulate(schedule="1f1b", pp=4, microbatches=8, f_s=1.0, b_s=2.0, link_s=0.0) -> list[dict]:
    """The spans of `schedule` on ideal ranks: F takes f_s, B b_s, a send link_s; an action
    starts when its rank is free and its input has arrived (the time between is a WAIT)."""
    done: dict[tuple[str, int, int], float] = {}
    ranks = [{"rank": r, "spans": []} for r in range(pp)]
    free, nxt = [0.0] * pp, [0] * pp
    orders = _orders(schedule, pp, microbatches)
    while any(n < len(o) for n, o in zip(nxt, orders)):
        for r in range(pp):
            if nxt[r] == len(orders[r]):
                continue
            kind, j = orders[r][nxt[r]]
            source = (("F", j, r - 1) if r > 0 else None) if kind == "F" else \
                (("B", j, r + 1) if r < pp - 1 else ("F", j, r))
            if source is not None and source not in done:
                continue
            arrives = 0.0 if source is None else done[source] + (link_s if source[2] != r else 0.0)
            start = max(free[r], arrives)
            spans = ranks[r]["spans"]
            if start > free[r]:
                spans.append(_span("compute", "WAIT", f"WAIT {kind}{j}.{r}", free[r], start))
            if source is not None and source[2] != r:
                recv = f"RECV_{kind}{j}.{r}"
                spans.append(_span("comm", recv[:6], recv, done[source], arrives))
                ranks[source[2]]["spans"].append(_span("comm", "SEND" + recv[4:6], "SEND" + recv[4:],
                                                       done[source], arrives))
            free[r] = done[(kind, j, r)] = start + (f_s if kind == "F" else b_s)
            spans.append(_span("compute", kind, f"{kind}{j}.{r}", start, free[r]))
            if kind == "F" and r == 0:  # rank 0 stashes the most: its activations go to the host
                spans.append(_span("copy", "OFFLOAD", f"OFFLOAD{j}.0", free[r], free[r] + f_s / 2))
            nxt[r] += 1
    end = max(free)
    for rank in ranks:
        rank["spans"] += [_span("compute", "SYNC", "SYNC", end, end + f_s), _span("compute", "OPT", "OPT", end + f_s, end + 2 * f_s)]
    return ranks


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,microbatches", [(2, 2), (4, 8), (3, 5)])
def test_ideal_schedules_measure_their_theoretical_bubble(schedule, pp, microbatches):
    ranks = simulate(schedule, pp, microbatches)
    # with free links both schedules idle (pp - 1) / (microbatches + pp - 1) of the phase
    # (GPipe, Megatron-LM); rel 1e-12: the two sides divide different integers
    assert measured_bubble(ranks) == pytest.approx((pp - 1) / (microbatches + pp - 1), rel=1e-12)
    assert measured_bubble(simulate(schedule, pp, microbatches, link_s=0.25)) > measured_bubble(ranks)


def test_the_file_round_trips_atomically(tmp_path):
    path = tmp_path / "pipeline_timeline.json"
    ranks = list(reversed(TWO_RANKS))
    write_pipeline_timeline(path, ranks, step=5, pp=2, schedule="1f1b", microbatches=1,
                            bubble_measured=measured_bubble(ranks), bubble_theory=0.5)
    assert [p.name for p in tmp_path.iterdir()] == ["pipeline_timeline.json"]  # no .tmp left
    doc = read_pipeline_timeline(path)
    assert doc["ranks"] == TWO_RANKS  # sorted by rank
    assert (doc["step"], doc["schedule"], doc["bubble_measured"]) == (5, "1f1b", 0.5625)
    assert pipeline_summary(doc) == "step 5, 1f1b, pp 2, 1 microbatches: bubble 56.2% measured, 50.0% in theory"
    assert pipeline_summary({"ranks": TWO_RANKS}) == \
        "step ?, ?, pp ?, ? microbatches: bubble 56.2% measured, n/a in theory"


def test_labels_are_the_microbatch():
    assert [_microbatch(n) for n in ("F3.0", "B12.1", "W0.3", "OPT")] == ["3", "12", "0", ""]


def _run_dir(tmp_path, ranks, **meta):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"step": 5, "loss": 4.0, "tokens_per_s": 1000.0, "comm_bytes": {"send": 4096, "total": 4096},
              "peak_mem_bytes": 2**28}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    write_pipeline_timeline(run_dir / "pipeline_timeline.json", ranks, **meta)
    return run_dir


def test_report_draws_the_pipeline_and_prints_its_bubble(tmp_path, capsys):
    ranks = simulate("1f1b", pp=4, microbatches=8, link_s=0.1)
    run_dir = _run_dir(tmp_path, ranks, step=5, pp=4, schedule="1f1b", microbatches=8,
                       bubble_measured=measured_bubble(ranks), bubble_theory=3 / 11)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == str(run_dir / "report.png")  # the first line is what it always was
    assert out[1] == (f"{run_dir / 'pipeline_timeline.png'}: step 5, 1f1b, pp 4, 8 microbatches: "
                      f"bubble {100 * measured_bubble(ranks):.1f}% measured, 27.3% in theory")
    data = (run_dir / "pipeline_timeline.png").read_bytes()
    assert data[:8] == PNG and len(data) > 30_000  # four rows of labelled boxes and strips
    assert not (run_dir / "pipeline_timeline.png.tmp").exists()
    assert not (run_dir / "timeline.png").exists()


def test_report_draws_timelines_without_meta_or_spans(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, [{"rank": 0, "spans": []}, {"rank": 1, "spans": [
        _span("compute", "RECOMPUTE", "RECOMPUTE3.1", 0.0, 1.0)]}])  # a kind this chart does not know
    assert main(["report", str(run_dir)]) == 0
    assert "bubble n/a measured, n/a in theory" in capsys.readouterr().out
    assert (run_dir / "pipeline_timeline.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("text,expected", [
    ('{"ranks": [{"rank": 0, "spans": [', "pipeline_timeline.json' is not valid JSON"),
    ('{"step": 5}', 'has no list of "ranks"'),
    ('{"ranks": []}', 'has no list of "ranks"'),
    ('{"pp": "two", "ranks": [{"rank": 0, "spans": []}]}', "pp='two' is not a count"),
    ('{"ranks": [{"spans": []}]}', "ranks[0]"),
    ('{"ranks": [{"rank": 0, "spans": []}, {"rank": 0, "spans": []}]}', "rank 0 appears twice"),
    ('{"ranks": [{"rank": 1, "spans": [{"lane": "compute", "kind": "F", "name": "F0.1", '
     '"start_s": 2, "end_s": 1}]}]}', "rank 1 span 0"),
    ('{"ranks": [{"rank": 0, "spans": [{"lane": "disk", "kind": "F", "name": "F0.0", '
     '"start_s": 0, "end_s": 1}]}]}', "compute, comm, copy"),
])
def test_damaged_pipeline_timeline_exits_2_and_writes_nothing(tmp_path, capsys, text, expected):
    run_dir = _run_dir(tmp_path, TWO_RANKS)
    (run_dir / "pipeline_timeline.json").write_text(text)
    (run_dir / "pipeline_timeline.png").write_bytes(PNG + b"an earlier chart")
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (run_dir / "report.png").exists()
    assert (run_dir / "pipeline_timeline.png").read_bytes() == PNG + b"an earlier chart"  # kept
    with pytest.raises(TimelineError):
        read_pipeline_timeline(run_dir / "pipeline_timeline.json")
