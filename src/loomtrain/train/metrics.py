"""Run metrics: `metrics.jsonl` (one JSON object per logged step), the rank-0 progress bar and
step line, peak memory and MFU (train/mfu.py)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from loomtrain.errors import UserError
from loomtrain.train.mfu import Utilization
from loomtrain.writes import write_atomic, write_error, writing


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
    """`path` holding `records`, replaced by one rename (WriteError: the old file stays)."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def open_log(path: Path):
    """metrics.jsonl for appending, unbuffered: every record reaches the file in `_append`,
    where a failure can be undone, not in a later flush or close."""
    with writing(path):
        return open(path, "ab", buffering=0)


def _append(file, line: str) -> None:
    """`line` at the end of `file` (opened by `open_log`), whole or not at all: a write that
    fails part way (a full disk, a file-size limit) is cut off again, so the run leaves no torn
    last line (measured without this: a 2,500-byte RLIMIT_FSIZE left 2,500 bytes, the last
    record cut mid-line), and the WriteError names the file."""
    end = os.fstat(file.fileno()).st_size  # appends go at the end
    data = memoryview(line.encode())
    try:
        while data:
            data = data[file.write(data):]
    except OSError as err:
        with contextlib.suppress(OSError):  # shrinking a file needs no space
            os.ftruncate(file.fileno(), end)
        raise write_error(file.name, err) from None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024


class RunLog:
    """Rank 0 writes metrics and draws the bar; other ranks hold a disabled RunLog.
    `utilization` turns each record's tokens/s into its `mfu` (None: a mode whose FLOPs are
    not counted, `mfu` null)."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool,
                 progress: bool, utilization: Utilization | None = None):
        self.enabled = enabled
        self.utilization = utilization or Utilization(None, None, 1, "not counted in this mode")
        self.file = open_log(run_dir / "metrics.jsonl") if enabled else None
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not (enabled and progress),
                        unit="step", dynamic_ncols=True, file=sys.stderr)

    def record(self, rec: dict) -> None:
        if not self.enabled:
            return
        rec["mfu"] = self.utilization.mfu(rec["tokens_per_s"])
        _append(self.file, json.dumps(rec) + "\n")
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
                f"{link} | {self.utilization.describe(rec['mfu'])}")
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
        self.file = open_log(path)

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
