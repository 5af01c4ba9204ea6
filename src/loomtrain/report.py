"""`loom report RUN_DIR`: one PNG of a run's metrics.jsonl (RUN_DIR/report.png) and, when the
run recorded them, its step timeline (timeline.png, `write_timeline_png`, which benchmarks
reuse), the pipeline's Gantt chart (pipeline_timeline.png, gantt.py) and the experts' loads of
a mixture-of-experts run (experts.png, report_experts.py). The records and files
it reads, and what each picture shows: docs/training.md, "Report".
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from loomtrain.errors import UserError
from loomtrain.gantt import draw_pipeline_timeline, pipeline_summary
from loomtrain.report_experts import draw_experts, expert_records
from loomtrain.timeline import PIPELINE_TIMELINE_JSON, hidden_s, overlap_s, read_pipeline_timeline

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


def _save(fig, out: Path) -> str:
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out)  # a reader never sees half a PNG
    return str(out)


def write_report(run_dir: str | Path) -> str:
    """Draw RUN_DIR/report.png from RUN_DIR/metrics.jsonl, RUN_DIR/timeline.png from
    RUN_DIR/timeline.json, RUN_DIR/pipeline_timeline.png from RUN_DIR/pipeline_timeline.json
    and RUN_DIR/experts.png from the records' expert metrics where they exist; returns the
    report's path. All inputs are validated before anything is written."""
    run_dir = Path(run_dir)
    records = load_records(run_dir)
    experts = expert_records(records, repr(str(run_dir / "metrics.jsonl")))
    timeline_json, pipeline_json = run_dir / TIMELINE_JSON, run_dir / PIPELINE_TIMELINE_JSON
    timeline = load_timeline(timeline_json) if timeline_json.is_file() else None
    pipeline = read_pipeline_timeline(pipeline_json) if pipeline_json.is_file() else None
    finite = [r["loss"] for r in records if math.isfinite(r["loss"])]
    last = f", last loss {finite[-1]:.4f}" if finite else ""
    steps = f"steps {records[0]['step']}-{records[-1]['step']}"
    title = f"{run_dir}: {len(records)} records, {steps}{last}"
    out = _save(_draw(records, title), run_dir / "report.png")
    if timeline is not None:
        _save(_draw_timeline(timeline, str(run_dir)), run_dir / "timeline.png")
    if pipeline is not None:
        _save(draw_pipeline_timeline(pipeline, str(run_dir)), run_dir / PIPELINE_PNG)
    if experts:
        _save(draw_experts(experts, f"{run_dir}: experts"), run_dir / "experts.png")
    return out


PIPELINE_PNG = "pipeline_timeline.png"


def pipeline_note(run_dir: str | Path) -> str | None:
    """The line `loom report` prints under the report's path for a pipeline run (the chart's
    path, the schedule and the bubble); None without a pipeline timeline."""
    pipeline_json = Path(run_dir) / PIPELINE_TIMELINE_JSON
    if not pipeline_json.is_file():
        return None
    return f"{Path(run_dir) / PIPELINE_PNG}: {pipeline_summary(read_pipeline_timeline(pipeline_json))}"


# --- the timeline of one step ------------------------------------------------------------------

TIMELINE_JSON = "timeline.json"
LANES = ("compute", "gather", "reduce")  # the ZeRO engine's (parallel/zero/engine.py), top down
# compute spans are named "forward UNIT", "backward UNIT" or "wait gather UNIT" (engine.py)
COLORS = {"forward": "tab:blue", "backward": "tab:orange", "wait": "tab:red",
          "gather": "tab:green", "reduce": "tab:purple"}


def load_timeline(path: str | Path) -> dict:
    """The validated contents of a timeline JSON file as `Timeline.write` writes it."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"timeline file {str(path)!r} does not exist (a run writes "
                          "timeline.json when run.timeline_step is set)")
    try:
        doc = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as err:
        raise ReportError(f"{str(path)!r} is not valid JSON ({err.msg} at line {err.lineno}); "
                          "delete it to report the metrics alone") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("spans"), list):
        raise ReportError(f"{str(path)!r} has no list of \"spans\"; a timeline is "
                          '{"step": .., "rank": .., "spans": [{"lane", "name", "start_s", "end_s"}]}')
    for i, span in enumerate(doc["spans"]):
        ok = (isinstance(span, dict) and isinstance(span.get("lane"), str)
              and isinstance(span.get("name"), str)
              and all(_number(span.get(k)) and math.isfinite(span[k]) for k in ("start_s", "end_s")))
        if not ok or span["end_s"] < span["start_s"]:
            raise ReportError(f"{str(path)!r}: span {i} ({span!r}) is not a lane, a name and "
                              "finite start_s <= end_s")
    return doc


def busy_s(spans: list[dict], lane: str) -> float:
    """Seconds during which at least one span of `lane` runs (a lane overlaps itself exactly there)."""
    return overlap_s(spans, lane, lane)


def timeline_title(doc: dict, source: str) -> str:
    spans = doc["spans"]
    if not spans:
        return f"{source}: step {doc.get('step', '?')}, rank {doc.get('rank', '?')}: no spans recorded"
    start = min(s["start_s"] for s in spans)
    end = max(s["end_s"] for s in spans)
    parts = []
    for lane in ("gather", "reduce"):
        busy = busy_s(spans, lane)
        if busy > 0:
            hidden = hidden_s(spans, lane)
            parts.append(f"{lane} {busy * 1e3:.1f} ms, {hidden * 1e3:.1f} ms ({100 * hidden / busy:.0f}%) "
                         "overlapping compute")
    waits = sum(s["end_s"] - s["start_s"] for s in spans
                if s["lane"] == "compute" and s["name"].startswith("wait"))
    if waits > 0:
        parts.append(f"compute waited {waits * 1e3:.1f} ms for gathers")
    return (f"{source}: step {doc.get('step', '?')}, rank {doc.get('rank', '?')}, "
            f"{(end - start) * 1e3:.1f} ms\n" + "; ".join(parts or ["no communication recorded"]))


def _kind(span: dict) -> str:
    if span["lane"] == "compute":
        return next((k for k in ("forward", "backward", "wait") if span["name"].startswith(k)), "forward")
    return span["lane"] if span["lane"] in COLORS else "reduce"


def _stack(spans: list[dict]) -> list[int]:
    """A row for every span, so spans of one lane that run at once (several gathers in flight)
    sit side by side: the first row whose last span has ended (interval partitioning)."""
    ends: list[float] = []
    rows = []
    for s in spans:
        row = next((i for i, e in enumerate(ends) if e <= s["start_s"]), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = s["end_s"]
        rows.append(row)
    return rows


def _draw_timeline(doc: dict, source: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    spans = sorted(doc["spans"], key=lambda s: s["start_s"])
    present = {s["lane"] for s in spans}
    lanes = [lane for lane in LANES if lane in present] + sorted(present - set(LANES)) or list(LANES)
    t0 = min((s["start_s"] for s in spans), default=0.0)
    width = max((s["end_s"] for s in spans), default=t0 + 1e-3) - t0 or 1e-3
    fig = Figure(figsize=(14, 1.6 + 1.1 * len(lanes)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, lane in enumerate(lanes):
        y = len(lanes) - 1 - i  # the first lane on top
        mine = [s for s in spans if s["lane"] == lane]
        rows = _stack(mine)
        height = 0.8 / (max(rows, default=0) + 1)
        for s, row in zip(mine, rows):
            x, w = (s["start_s"] - t0) * 1e3, (s["end_s"] - s["start_s"]) * 1e3
            bottom = y - 0.4 + row * height
            ax.broken_barh([(x, w)], (bottom, height * 0.9), facecolors=COLORS[_kind(s)])
            if w > width * 1e3 / 40:  # label the bars wide enough to hold their unit's name
                ax.text(x + w / 2, bottom + height * 0.45, s["name"].split()[-1], ha="center",
                        va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(lanes)), lanes[::-1])
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(0, width * 1e3)
    ax.set_xlabel("ms since the step's first span")
    ax.grid(axis="x", alpha=0.3)
    kinds = {_kind(s) for s in spans}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items() if k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(timeline_title(doc, source))
    return fig


def write_timeline_png(timeline_json: str | Path, png: str | Path, title: str | None = None) -> str:
    """Draw the timeline in `timeline_json` into `png`; returns its path. `title` names the
    source in the figure's title (default: the JSON file's path)."""
    doc = load_timeline(timeline_json)
    return _save(_draw_timeline(doc, title or str(timeline_json)), Path(png))
