"""`loom report RUN_DIR`: the PNGs from a metrics.jsonl and a timeline.json, and errors for
people on bad input."""

from __future__ import annotations

import json
import math

import pytest

from loomtrain.cli import main
from loomtrain.report import (_stack, comm_series, load_records, timeline_title, write_report,
                              write_timeline_png)
from loomtrain.timeline import Timeline


def _record(step: int, **extra) -> dict:
    """A record as train/trainer.py writes it."""
    rec = {"step": step, "loss": 5.0 / step, "lr": 1e-3, "grad_norm": 0.5,
           "tokens_per_s": 1000.0 + step, "comm_bytes": {"all_reduce": 4096 * step, "total": 4096 * step},
           "peak_mem_bytes": 300 * 2**20}
    rec.update(extra)
    return rec


def _write(run_dir, records=None, text=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    if text is None:
        text = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def test_report_writes_a_png(tmp_path):
    records = [_record(s) for s in range(1, 11)] + [_record(11, val_loss=0.6, loss=math.nan)]
    run_dir = _write(tmp_path / "run", records)
    path = write_report(run_dir)
    assert path == str(run_dir / "report.png")
    data = (run_dir / "report.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # four drawn panels
    assert not (run_dir / "report.png.tmp").exists()
    assert not (run_dir / "timeline.png").exists()  # no timeline.json: no timeline


def test_report_command_prints_the_path(tmp_path, capsys):
    run_dir = _write(tmp_path / "run", [_record(1), _record(2)])
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report.png")


def test_comm_series_fills_missing_ops_and_totals():
    records = [_record(1, comm_bytes={"all_reduce": 10, "broadcast": 5, "total": 15}),
               _record(2, comm_bytes={"all_reduce": 7}),
               _record(3, comm_bytes=3)]
    assert comm_series(records) == {"all_reduce": [10, 7, 0], "broadcast": [5, 0, 0],
                                    "total": [15, 7, 3]}


def test_blank_lines_are_skipped(tmp_path):
    run_dir = _write(tmp_path / "run", text=json.dumps(_record(1)) + "\n\n" + json.dumps(_record(2)) + "\n")
    assert [r["step"] for r in load_records(run_dir)] == [1, 2]


@pytest.mark.parametrize("case,text,expected", [
    ("empty", "", "holds no records"),
    ("blank", "\n\n", "holds no records"),
    ("torn", json.dumps(_record(1)) + '\n{"step": 2, "lo', "line 2 is not valid JSON"),
    ("not an object", "[1, 2]\n", "line 1 is not a JSON object"),
    ("missing key", json.dumps({"step": 1, "loss": 2.0}) + "\n", "has no 'tokens_per_s'"),
    ("wrong type", json.dumps(_record(1, loss="low")) + "\n", "loss='low' is not a number"),
    ("bad comm", json.dumps(_record(1, comm_bytes=[1])) + "\n", "comm_bytes=[1]"),
])
def test_bad_metrics_exit_2_with_one_paragraph(tmp_path, capsys, case, text, expected):
    run_dir = _write(tmp_path / "run", text=text)
    assert main(["report", str(run_dir)]) == 2, case
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and "metrics.jsonl" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (run_dir / "report.png").exists()


@pytest.mark.parametrize("make,expected", [
    (lambda p: p / "nowhere", "does not exist"),
    (lambda p: p, "has no metrics.jsonl"),
])
def test_missing_run_folder_or_file_exits_2(tmp_path, capsys, make, expected):
    assert main(["report", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and "Traceback" not in err, err


# --- the timeline ------------------------------------------------------------------------------

# Seconds. Compute works on [0, 1] and [1.5, 2.5] and waits on [1, 1.5]; two gathers are in
# flight at once on [0.6, 1.2]; gathering covers [0.5, 1.5], of which [0.5, 1] overlaps work;
# the reduction covers [2, 3], of which [2, 2.5] does.
SPANS = [("compute", "forward blocks.0", 0.0, 1.0), ("gather", "all_gather blocks.1", 0.5, 1.5),
         ("gather", "all_gather blocks.2", 0.6, 1.2), ("compute", "wait gather blocks.1", 1.0, 1.5),
         ("compute", "forward blocks.1", 1.5, 2.5), ("reduce", "reduce_scatter blocks.1", 2.0, 3.0)]


def _timeline(path, spans=SPANS):
    """timeline.json as the trainer writes it, through the real writer."""
    timeline = Timeline()
    timeline.origin = 0.0  # spans at the given seconds
    for lane, name, start, end in spans:
        timeline.span(lane, name, start, end)
    timeline.write(path, step=3, rank=0)
    return path


def test_timeline_title_states_the_overlap_with_compute(tmp_path):
    doc = json.loads(_timeline(tmp_path / "timeline.json").read_text())
    assert timeline_title(doc, "run") == (
        "run: step 3, rank 0, 3000.0 ms\n"
        "gather 1000.0 ms, 500.0 ms (50%) overlapping compute; "  # the wait hides nothing
        "reduce 1000.0 ms, 500.0 ms (50%) overlapping compute; compute waited 500.0 ms for gathers")
    assert "no spans recorded" in timeline_title({"step": 1, "rank": 0, "spans": []}, "run")


def test_concurrent_spans_of_a_lane_are_stacked():
    spans = [{"start_s": a, "end_s": b} for a, b in [(0, 2), (1, 3), (2, 4), (2.5, 5), (4, 6)]]
    assert _stack(spans) == [0, 1, 0, 2, 0]  # (2.5, 5) overlaps the spans on rows 0 and 1


def test_report_draws_the_timeline_when_the_run_recorded_one(tmp_path, capsys):
    run_dir = _write(tmp_path / "run", [_record(1), _record(2)])
    _timeline(run_dir / "timeline.json")
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report.png")
    for name in ("report.png", "timeline.png"):
        assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not (run_dir / "timeline.png.tmp").exists()


def test_write_timeline_png_renders_any_timeline_file(tmp_path):
    source = _timeline(tmp_path / "bench.json")
    out = write_timeline_png(source, tmp_path / "out.png", title="ZeRO-3, prefetch 1")
    assert out == str(tmp_path / "out.png")
    data = (tmp_path / "out.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # three lanes of bars
    empty = _timeline(tmp_path / "empty.json", spans=[])
    assert write_timeline_png(empty, tmp_path / "empty.png") == str(tmp_path / "empty.png")


@pytest.mark.parametrize("text,expected", [
    ('{"step": 3, "spans": [', "timeline.json' is not valid JSON"),
    ('{"step": 3}', 'has no list of "spans"'),
    ('{"spans": [{"lane": "gather", "name": "x", "start_s": 2, "end_s": 1}]}', "span 0"),
    ('{"spans": [{"lane": "gather", "start_s": 0, "end_s": 1}]}', "span 0"),
])
def test_bad_timeline_exits_2_and_writes_nothing(tmp_path, capsys, text, expected):
    run_dir = _write(tmp_path / "run", [_record(1)])
    (run_dir / "timeline.json").write_text(text)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (run_dir / "report.png").exists() and not (run_dir / "timeline.png").exists()


def _experts(step: int, loads=((30, 10, 20, 4), (16, 16, 16, 16))) -> dict:
    return {"moe_tokens_per_expert": [list(row) for row in loads],
            "moe_load_imbalance": 1.875 - step / 100, "moe_aux_loss": 1.2 - step / 100}


def test_a_mixture_of_experts_run_gets_its_picture(tmp_path):
    run_dir = _write(tmp_path / "run", [_record(s, **_experts(s)) for s in range(1, 6)])
    write_report(run_dir)
    data = (run_dir / "experts.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # three drawn panels
    plain = _write(tmp_path / "plain", [_record(1), _record(2)])
    write_report(plain)
    assert not (plain / "experts.png").exists()


@pytest.mark.parametrize("bad", [
    {"moe_tokens_per_expert": [[1, 2], [3]]},  # blocks of different sizes
    {"moe_tokens_per_expert": "many"},
    {"moe_load_imbalance": None},
])
def test_bad_expert_metrics_are_refused_before_anything_is_written(tmp_path, capsys, bad):
    run_dir = _write(tmp_path / "run", [_record(1, **_experts(1)), _record(2, **{**_experts(2), **bad})])
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "step 2" in err and "Traceback" not in err
    assert not (run_dir / "report.png").exists() and not (run_dir / "experts.png").exists()
