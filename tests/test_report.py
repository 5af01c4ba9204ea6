"""`loom report RUN_DIR`: the PNG from a metrics.jsonl, and errors for people on bad input."""

from __future__ import annotations

import json
import math

import pytest

from loomtrain.cli import main
from loomtrain.report import comm_series, load_records, write_report


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
