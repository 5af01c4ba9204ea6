"""The pipeline's timeline of one step as a Gantt chart: one row per pp rank (rank 0 on top),
milliseconds across, compute boxes by kind, strips of sends/receives and host copies, dashed
lines around the phase the bubble is measured over. Drawn by `loom report` from
RUN_DIR/pipeline_timeline.json (timeline.py); details: docs/training.md, "Report".
"""

from __future__ import annotations

import math
import re

from loomtrain.timeline import WORK_KINDS, measured_bubble

# kind -> (legend group, colour); kinds a newer runtime adds are drawn as "other"
KINDS = {"F": ("F forward", "tab:blue"), "B": ("B backward", "tab:orange"),
         "I": ("I backward, input gradient", "tab:red"), "W": ("W backward, weight gradient", "tab:green"),
         "WAIT": ("waiting for a receive", "lightgrey"), "OPT": ("optimizer step", "dimgrey"),
         "SYNC": ("gradient all-reduce", "darkgrey"),
         "SEND_F": ("activations sent / received", "tab:cyan"), "RECV_F": ("activations sent / received", "tab:cyan"),
         "SEND_B": ("gradients sent / received", "tab:pink"), "RECV_B": ("gradients sent / received", "tab:pink"),
         "OFFLOAD": ("activations offloaded", "tab:purple"), "RELOAD": ("activations reloaded", "tab:olive")}
OTHER = ("other", "tab:brown")
LEGEND_ORDER = list(dict.fromkeys(group for group, _ in [*KINDS.values(), OTHER]))
# where each lane sits inside a rank's row of height 1 (bottom, height); the comm strip is
# split, sends above receives, as a send and a receive are often in flight together (1F1B)
COMPUTE_BOX, SEND_BOX, RECV_BOX, COPY_BOX = (0.30, 0.62), (0.215, 0.065), (0.15, 0.065), (0.03, 0.09)


def pipeline_summary(doc: dict) -> str:
    """One line: the step, the schedule and the bubble, measured and in theory. The measured
    bubble is the runtime's when it wrote one, else measured here from the spans."""
    measured = doc.get("bubble_measured", measured_bubble(doc["ranks"]))
    theory = doc.get("bubble_theory", math.nan)

    def percent(value):
        return "n/a" if math.isnan(value) else f"{100 * value:.1f}%"
    return (f"step {doc.get('step', '?')}, {doc.get('schedule', '?')}, pp {doc.get('pp', '?')}, "
            f"{doc.get('microbatches', '?')} microbatches: bubble {percent(measured)} measured, "
            f"{percent(theory)} in theory")


def _box(span: dict) -> tuple[float, float]:
    if span["lane"] == "compute":
        return COMPUTE_BOX
    if span["lane"] == "copy":
        return COPY_BOX
    return RECV_BOX if span["kind"].startswith("RECV") else SEND_BOX


def _microbatch(name: str) -> str:
    """"F3.0" (an Action: kind, microbatch, stage) -> "3"; "" for a name without a number."""
    found = re.search(r"\d+", name)
    return found.group() if found else ""


def draw_pipeline_timeline(doc: dict, source: str):
    """The Gantt chart of a validated pipeline timeline (`read_pipeline_timeline`) as a Figure;
    `source` names the run in the title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = doc["ranks"]
    spans = [s for r in ranks for s in r["spans"]]
    t0 = min((s["start_s"] for s in spans), default=0.0)
    width_ms = (max((s["end_s"] for s in spans), default=t0) - t0) * 1e3 or 1.0
    fig = Figure(figsize=(14, 1.6 + 0.9 * len(ranks)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bars: dict[tuple, list] = {}  # one broken_barh call per (group, colour, box): thousands of spans draw fast
    for i, rank in enumerate(ranks):
        y = len(ranks) - 1 - i
        for s in rank["spans"]:
            x, w = (s["start_s"] - t0) * 1e3, (s["end_s"] - s["start_s"]) * 1e3
            bottom, height = _box(s)
            group, colour = KINDS.get(s["kind"], OTHER)
            bars.setdefault((group, colour, y + bottom, height, s["lane"]), []).append((x, w))
            label = _microbatch(s["name"]) if s["kind"] in WORK_KINDS else ""
            if label and w > width_ms * 0.006 * (len(label) + 1):  # wide enough to hold it
                ax.text(x + w / 2, y + bottom + height / 2, label, ha="center", va="center",
                        fontsize=7, clip_on=True)
    for (group, colour, bottom, height, lane), ranges in bars.items():
        style = {"hatch": "///", "edgecolor": "grey"} if group == KINDS["WAIT"][0] else \
            {"edgecolor": "white", "linewidth": 0.5} if lane == "compute" else {"alpha": 0.8}
        ax.broken_barh(ranges, (bottom, height), facecolors=colour, **style)

    work = [s for s in spans if s["kind"] in WORK_KINDS]
    if work:
        for edge in (min(s["start_s"] for s in work), max(s["end_s"] for s in work)):
            ax.axvline((edge - t0) * 1e3, color="black", linestyle="--", linewidth=0.8, alpha=0.6)
    rows = range(len(ranks))
    ax.set_yticks([y + COMPUTE_BOX[0] + COMPUTE_BOX[1] / 2 for y in rows],
                  [f"rank {r['rank']}" for r in reversed(ranks)])
    ax.set_yticks([y + b[0] + b[1] / 2 for y in rows for b in (SEND_BOX, RECV_BOX, COPY_BOX)],
                  ["send", "recv", "copy"] * len(ranks), minor=True)
    ax.tick_params(axis="y", which="minor", labelsize=6, length=0)
    ax.set_ylim(0, len(ranks))
    ax.set_xlim(0, width_ms)
    ax.set_xlabel("ms since the step's first span (dashed: the forward/backward phase the bubble is measured over)")
    ax.grid(axis="x", alpha=0.3)
    legend = sorted({(g, c) for g, c, *_ in bars}, key=lambda gc: LEGEND_ORDER.index(gc[0]))
    ax.legend(handles=[Patch(facecolor=c, label=g, hatch="///" if g == KINDS["WAIT"][0] else None)
                       for g, c in legend], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(f"{source}: {pipeline_summary(doc)}" + ("" if spans else "\nno spans recorded"))
    return fig
