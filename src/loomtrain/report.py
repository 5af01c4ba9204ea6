"""`loom report RUN_DIR`: one PNG of a run's metrics.jsonl (loss and validation loss,
throughput, peak memory, communication per logged record), written to RUN_DIR/report.png.

The records are the trainer's (train/trainer.py): `step`, `loss`, `tokens_per_s`,
`peak_mem_bytes` and `comm_bytes` ({op: wire bytes, "total"} since the previous record) are
required; `val_loss` appears on evaluation steps. Drawing uses matplotlib's Agg canvas on a
`Figure` of its own, so no pyplot state or display is involved.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from loomtrain.errors import UserError

REQUIRED = ("step", "loss", "tokens_per_s", "comm_bytes", "peak_mem_bytes")
MIB = 2**20


class ReportError(UserError):
    """A run folder or metrics file that cannot be plotted."""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_record(rec, where: str) -> None:
    if not isinstance(rec, dict):
        raise ReportError(f"{where} is not a JSON object (each line of metrics.jsonl is a record)")
    for key in REQUIRED:
        if key not in rec:
            raise ReportError(f"{where} has no {key!r}; every record needs {', '.join(REQUIRED)}")
    numbers = ("step", "loss", "tokens_per_s", "peak_mem_bytes", "val_loss")
    for key in (k for k in numbers if k in rec):
        if not _number(rec[key]):
            raise ReportError(f"{where}: {key}={rec[key]!r} is not a number")
    comm = rec["comm_bytes"]
    if not (_number(comm) or (isinstance(comm, dict) and all(map(_number, comm.values())))):
        raise ReportError(f"{where}: comm_bytes={comm!r} is neither a number nor {{op: bytes}}")


def load_records(run_dir: Path) -> list[dict]:
    """The validated records of RUN_DIR/metrics.jsonl, in file order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run folder {str(run_dir)!r} does not exist (give the folder "
                          "`loom train` printed as 'run folder: ...')")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{str(run_dir)!r} has no metrics.jsonl: is it a loom run folder?")
    records = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(f"{str(path)!r} line {n} is not valid JSON ({err.msg}); the file "
                              "may be torn by a crash: delete that line to plot the rest") from None
        _check_record(rec, f"{str(path)!r} line {n}")
        records.append(rec)
    if not records:
        raise ReportError(f"{str(path)!r} holds no records: the run has not logged a step yet "
                          "(it logs every run.log_every steps)")
    return records


def comm_series(records: list[dict]) -> dict[str, list[float]]:
    """Wire bytes per record for every op seen (0 where a record lacks it), "total" last.
    A plain number counts as the total; a dict without "total" sums its ops."""
    tables = [r["comm_bytes"] if isinstance(r["comm_bytes"], dict) else {"total": r["comm_bytes"]}
              for r in records]
    ops = sorted({op for t in tables for op in t} - {"total"})
    series = {op: [float(t.get(op, 0)) for t in tables] for op in ops}
    series["total"] = [float(t["total"]) if "total" in t else float(sum(t.values())) for t in tables]
    return series


def _from_zero(ax, values: list[float]) -> None:
    """y from 0 to 10% above the largest value, so a constant series stays off the frame."""
    top = max((v for v in values if math.isfinite(v)), default=0.0)
    ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)


def _draw(records: list[dict], title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    (loss_ax, speed_ax), (mem_ax, comm_ax) = fig.subplots(2, 2)
    steps = [r["step"] for r in records]

    loss_ax.plot(steps, [r["loss"] for r in records], ".-", label="train loss")
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        loss_ax.plot(*zip(*val), "o-", label="validation loss")
    loss_ax.set(title="loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    loss_ax.legend()

    speed = [r["tokens_per_s"] for r in records]
    speed_ax.plot(steps, speed, ".-", color="tab:green")
    speed_ax.set(title="throughput", xlabel="step", ylabel="tokens/s (all ranks)")
    _from_zero(speed_ax, speed)

    mem = [r["peak_mem_bytes"] / MIB for r in records]
    mem_ax.plot(steps, mem, ".-", color="tab:red")
    mem_ax.set(title="peak memory, rank 0 (CPU: resident set size)", xlabel="step", ylabel="MiB")
    _from_zero(mem_ax, mem)

    series = comm_series(records)
    if len(series) == 2:  # one op: its line is the total
        del series["total"]
    for op, values in series.items():
        style = {"color": "black", "linestyle": "--"} if op == "total" else {}
        comm_ax.plot(steps, [v / MIB for v in values], ".-", label=op, **style)
    comm_ax.set(title="communication since the previous record (rank 0 sends)",
                xlabel="step", ylabel="MiB")
    _from_zero(comm_ax, [v / MIB for v in series.get("total", next(iter(series.values())))])
    comm_ax.legend()

    for ax in (loss_ax, speed_ax, mem_ax, comm_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return fig


def write_report(run_dir: str | Path) -> str:
    """Draw RUN_DIR/report.png from RUN_DIR/metrics.jsonl; returns the PNG's path."""
    run_dir = Path(run_dir)
    records = load_records(run_dir)
    finite = [r["loss"] for r in records if math.isfinite(r["loss"])]
    last = f", last loss {finite[-1]:.4f}" if finite else ""
    steps = f"steps {records[0]['step']}-{records[-1]['step']}"
    title = f"{run_dir}: {len(records)} records, {steps}{last}"
    fig = _draw(records, title)
    out = run_dir / "report.png"
    tmp = run_dir / "report.png.tmp"
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out)  # a reader never sees half a PNG
    return str(out)
