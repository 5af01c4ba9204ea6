"""Run metrics: `metrics.jsonl` (one JSON object per logged step), the rank-0 progress bar and
step line, and peak memory."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from loomtrain.errors import UserError


class MetricsError(UserError):
    """A metrics.jsonl that cannot be read (exit code 2)."""


def peak_mem_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl. A last line that is not whole JSON (a crash
    while it was written) is left out; any other bad line is a MetricsError naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                break  # torn: the record being written when the run died
            raise MetricsError(f"{path}: line {n} is not a metrics record ({err}); the file is "
                               "damaged: move it aside to resume (the checkpoints do not "
                               "depend on it)") from None
    return records


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Keep the records up to `last_step` (the checkpoint a resumed run restarts from),
    rewriting the file atomically so a crash here loses nothing (a torn last line goes)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    _rewrite(path, [r for r in read_metrics(run_dir) if r["step"] <= last_step])


def _rewrite(path: Path, records: list[dict]) -> None:
    """`path` holding `records`, replaced by one rename."""
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024


class RunLog:
    """Rank 0 writes metrics and draws the bar; other ranks hold a disabled RunLog."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool,
                 progress: bool):
        self.enabled = enabled
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not (enabled and progress),
                        unit="step", dynamic_ncols=True, file=sys.stderr)

    def record(self, rec: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        val = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        if "val_accuracy" in rec:  # a classification task
            val += f" acc {rec['val_accuracy']:.3f}"
        link = f" (link {rec['comm_simulated_s']:.2f}s)" if "comm_simulated_s" in rec else ""
        # a zeroth-order step has no gradient norm: its mean projected gradient instead
        grad = (f"grad-norm {rec['grad_norm']:.3f}" if "grad_norm" in rec
                else f"zo-grad {rec['zo_grad']:.3g}")
        line = (f"step {rec['step']:>6} | loss {rec['loss']:.4f}{val} | {grad} | "
                f"lr {rec['lr']:.2e} | {rec['tokens_per_s']:.0f} tok/s | "
                f"mem {_fmt_bytes(rec['peak_mem_bytes'])} | comm {_fmt_bytes(rec['comm_bytes']['total'])}"
                f"{link} | mfu n/a")
        if self.bar.disable:
            print(line, file=sys.stderr, flush=True)
        else:
            self.bar.write(line, file=sys.stderr)

    def amend(self, fields: dict) -> None:
        """Add `fields` to the latest record (a run's summary that comes after it), rewriting
        the file atomically: a crash here loses nothing."""
        if not self.enabled:
            return
        self.file.close()
        path = Path(self.file.name)
        records = read_metrics(path.parent)
        if records:
            records[-1].update(fields)
        _rewrite(path, records)
        self.file = open(path, "a")

    def advance(self, loss: float | None, tokens_per_s: float) -> None:
        if self.enabled and not self.bar.disable:
            post = {"tok/s": f"{tokens_per_s:.0f}"}
            if loss is not None:
                post["loss"] = f"{loss:.3f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def message(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if not self.bar.disable else print)(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()
