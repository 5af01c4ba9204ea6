"""The picture of a simulated step (simulate.py): one band per pp rank, a lane per stream
(compute, comm and, with offload, copy), spans coloured by kind.

It stays readable for large configs (pp = 16, 64 microbatches: thousands of spans): spans of
one kind in one lane that touch, or leave a gap under a pixel, are merged into one bar,
bars are drawn per (lane, kind) in one call, and span names are written only when there
are few enough spans for them to fit. On the comm lane the tp/cp collectives, which block
their compute rather than queue on the stream, sit in the lower part of the lane.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

COLOURS = {"forward": "#4c78a8", "recompute": "#9ecae9", "backward": "#f58518",
           "backward_input": "#f58518", "backward_weight": "#e45756", "optimizer": "#54a24b",
           "send": "#b279a2", "gather": "#72b7b2", "grad_sync": "#eeca3b", "tp_cp": "#bab0ac",
           "offload": "#9d755d", "reload": "#d8b5a5"}
WIDTH_PX = 1600
MAX_LABELS = 150  # compute spans beyond which names are not written


def _merged(spans, gap_s: float) -> list[tuple[float, float]]:
    """(start, width) bars: consecutive spans closer than gap_s joined."""
    bars: list[list[float]] = []
    for x in sorted(spans, key=lambda x: x.start_s):
        if bars and x.start_s - bars[-1][1] <= gap_s:
            bars[-1][1] = max(bars[-1][1], x.end_s)
        else:
            bars.append([x.start_s, x.end_s])
    return [(a, b - a) for a, b in bars]


def draw(sim, path, title: str = "") -> Path:
    """Writes `sim`'s timeline to `path` (PNG); returns the path."""
    streams = [s for s in ("compute", "comm", "p2p", "copy")
               if any(x.stream == s for spans in sim.spans for x in spans)]
    lanes = len(streams) * sim.pp
    step_s = sim.step_time_s or 1.0
    scale, unit = (1e3, "ms") if step_s < 1 else (1.0, "s")
    fig = Figure(figsize=(WIDTH_PX / 100, min(2.0 + 0.32 * lanes, 24.0)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    gap_s = step_s / WIDTH_PX
    labels = sum(x.stream == "compute" for spans in sim.spans for x in spans) <= MAX_LABELS
    kinds, ticks, names = set(), [], []
    for r, spans in enumerate(sim.spans):
        for j, stream in enumerate(streams):
            y = -(r * (len(streams) + 0.5) + j)
            ticks.append(y)
            names.append(f"rank {r} {stream}")
            mine = [x for x in spans if x.stream == stream]
            for kind in sorted({x.kind for x in mine}):
                of_kind = [x for x in mine if x.kind == kind]
                low = stream == "comm" and kind == "tp_cp"
                bars = [(a * scale, w * scale) for a, w in _merged(of_kind, gap_s)]
                ax.broken_barh(bars, (y - 0.4, 0.35 if low else 0.8),
                               facecolors=COLOURS.get(kind, "#888888"),
                               edgecolor="white" if labels else "none", linewidth=0.3)
                kinds.add(kind)
            if labels and stream == "compute":
                for x in mine:
                    if (x.end_s - x.start_s) > step_s / 60 and x.kind != "optimizer":
                        ax.text((x.start_s + x.end_s) / 2 * scale, y, x.name, ha="center",
                                va="center", fontsize=6)
    ax.axvline(sim.step_time_s * scale, color="black", linewidth=0.8)
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_xlim(0, step_s * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    head = f"{title} — " if title else ""
    ax.set_title(f"{head}{sim.schedule}, pp={sim.pp}, {sim.microbatches} microbatches: step "
                 f"{sim.step_time_s * scale:.4g} {unit}, bubble {sim.bubble:.1%}", fontsize=10)
    ax.legend(handles=[Patch(color=COLOURS.get(k, "#888888"), label=k) for k in sorted(kinds)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
