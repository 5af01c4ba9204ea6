"""How fast a run notices and names a dead or stalled rank: `loom train` against plain torch
(DDP on gloo under torchrun, benchmarks/_ddp_peer.py), side by side.

    .venv/bin/python benchmarks/faults.py [--case all|dead|stall] [--rounds 3] [--world 4]
        [--kill-ranks 0,3] [--heartbeat-s 10] [--cap-s 120]

Both tools train the tiny GPT of the tests (d_model 32, 2 layers, seq 32, global batch 8, 60 KB
of the stdlib as corpus) on `--world` ranks of this host, gloo on loopback, until a fault, sent
once rank 0 has logged step 3:
- `dead`: rank k is SIGKILLed, for each k of --kill-ranks (default 0 and world - 1). Both
  tools' collective timeouts are 60 s (parallel.timeout_s; the peer's process group timeout).
- `stall`: rank 1 is SIGSTOPped. loomtrain runs with parallel.heartbeat_timeout_s = --heartbeat-s
  (parallel.timeout_s stays 60 s); the peer's process group timeout is --heartbeat-s, torch's
  one bound on a stalled peer.
The peer runs under `python -m torch.distributed.run --nproc-per-node W --standalone`.

Per round and tool, seconds from the signal: `first_error_s` (the first output written after
the signal that says "error", any case), `named_s` (the output names the signalled rank as the
failed one: loomtrain's `error: rank R ...` line, torchrun's "Root Cause (first observed
failure)" entry `rank : R`; None: it named another or none), `exit_s` (the tool's process
ended); `exit_code`, `named_rank` (the rank named in the end; None: none), `names_rank`
(whether that is the signalled rank; where not, what the tool said is printed on stderr), and
for scale `start_s` (the start to step 3 logged). A round is cut `--cap-s` seconds after the
signal: `timed_out`, and no exit_s or exit_code. Output polled every 10 ms. The tools take
turns, in the order L P, P L, L P, ..., so a drift in the machine's load falls on both alike.
Each round ends by stopping everything it started (SIGCONT, then SIGKILL: the launcher's
process group, and each rank, as torchrun's workers have sessions of their own).

The last line on stdout is one JSON object: `date`, `cpu_count`, `load_avg` (at the start),
and per case and tool the rounds, the medians of the timings (None where a round has none) and
`named_rounds` (how many rounds named the signalled rank), and `exit_s_ratio`, the peer's median
exit_s over loomtrain's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

from restart import tiny_tree, until, write_config

from loomtrain.train.metrics import read_metrics
from loomtrain.train.restart import rank_pids

PEER = Path(__file__).resolve().parent / "_ddp_peer.py"
TOOLS = ("loomtrain", "torch")
TIMINGS = ("start_s", "first_error_s", "named_s", "exit_s")
COLLECTIVE_TIMEOUT_S = 60
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # spinning OpenMP threads: test_checkpoint.py
NAMED = {  # the rank a tool's output names as the failed one
    "loomtrain": re.compile(r"^error: rank (\d+) .*", re.M),
    "torch": re.compile(r"Root Cause \(first observed failure\):\s*\[\d+\]:(?:\n(?!\[).*)*?"
                        r"\n\s*rank\s*:\s*(\d+)"),
}


class Fault(NamedTuple):
    signum: int
    rank: int
    stall_timeout_s: float  # loomtrain's heartbeat timeout; the peer's process group timeout


class Run(NamedTuple):
    proc: subprocess.Popen
    log: Path
    ranks: Callable[[], dict[int, int]]  # {rank: pid} of the ranks seen started
    stepped: Callable[[int], bool]  # whether rank 0 has logged that step


def _loomtrain(root: Path, world: int, fault: Fault) -> Run:
    tree = tiny_tree(root, world)  # restart.py's run, without checkpoints, running on
    tree["train"]["steps"], tree["checkpoint"]["every"] = 10**6, 0
    tree["parallel"]["timeout_s"] = COLLECTIVE_TIMEOUT_S
    if fault.signum == signal.SIGSTOP:
        tree["parallel"]["heartbeat_timeout_s"] = fault.stall_timeout_s
    proc = _start([sys.executable, "-m", "loomtrain", "train", str(write_config(root, tree))],
                  root)
    run_dir = root / "runs" / "t"
    return Run(proc, root / "out.txt", lambda: rank_pids(proc.pid),
               lambda step: (run_dir / "metrics.jsonl").exists()
               and len(read_metrics(run_dir)) >= step)


def _torch(root: Path, world: int, fault: Fault) -> Run:
    timeout_s = fault.stall_timeout_s if fault.signum == signal.SIGSTOP else COLLECTIVE_TIMEOUT_S
    corpus = tiny_tree(root, world)["data"]["source"]  # the same corpus, written to root
    pid_dir = root / "pids"
    pid_dir.mkdir()
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                   "--standalone", str(PEER), corpus, str(pid_dir), "--timeout-s", str(timeout_s)],
                  root)
    log = root / "out.txt"
    return Run(proc, log, lambda: {int(p.stem[4:]): int(p.read_text())
                                   for p in pid_dir.glob("rank*.pid")},
               lambda step: f"step {step} " in log.read_text())


def _start(argv: list[str], root: Path) -> subprocess.Popen:
    with (root / "out.txt").open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=out, env=ENV, start_new_session=True)


def _started_at(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc/PID/stat field 22): with the pid, an
    identity that a reused pid does not share. None: gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _watch(run: Run, tool: str, rank: int, sent: float, offset: int, cap_s: float) -> dict:
    """Poll the output written since the signal (from `offset`) and the tool's process until
    it ends or cap_s passes; the timings count from `sent`."""
    seen: dict[str, float | None] = {"first_error_s": None, "named_s": None}
    while (code := run.proc.poll()) is None and time.monotonic() - sent < cap_s:
        _note(seen, run.log.read_text()[offset:], tool, rank, time.monotonic() - sent)
        time.sleep(0.01)
    ended = time.monotonic() - sent
    text = run.log.read_text()[offset:]
    _note(seen, text, tool, rank, ended)
    named = _named_rank(tool, text)
    if named is not None and named != rank:  # for the record: what it said instead
        said = " ".join(NAMED[tool].search(text)[0].split())
        print(f"{tool} named rank {named}, not {rank}: {said}", file=sys.stderr)
    return {**seen, "exit_s": None if code is None else ended, "exit_code": code,
            "timed_out": code is None, "named_rank": named}


def _named_rank(tool: str, text: str) -> int | None:
    found = NAMED[tool].search(text)
    return found and int(found[1])


def _note(seen: dict, text: str, tool: str, rank: int, at_s: float) -> None:
    if seen["first_error_s"] is None and re.search("error", text, re.I):
        seen["first_error_s"] = at_s
    if seen["named_s"] is None and _named_rank(tool, text) == rank:
        seen["named_s"] = at_s


def _stop_all(run: Run, ranks: dict[int, str]) -> None:
    """SIGCONT then SIGKILL to the launcher's process group and to each rank still running as
    started (`ranks`: {pid: start time}); then wait for them to be gone."""
    for signum in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # all of it ended meanwhile
            if run.proc.poll() is None:
                os.killpg(run.proc.pid, signum)
        for pid, started in ranks.items():
            with contextlib.suppress(ProcessLookupError):
                if _started_at(pid) == started:
                    os.kill(pid, signum)
    run.proc.wait()
    until(lambda: all(_started_at(pid) != s for pid, s in ranks.items()), 30)


def one_round(tool: str, root: Path, world: int, fault: Fault, cap_s: float) -> dict:
    began = time.monotonic()
    run = (_loomtrain if tool == "loomtrain" else _torch)(root, world, fault)
    ranks: dict[int, str] = {}
    try:
        until(lambda: run.proc.poll() is not None or run.stepped(3), 180)
        if run.proc.poll() is not None:
            raise RuntimeError(f"{tool} ended before step 3:\n{run.log.read_text()[-3000:]}")
        start_s = time.monotonic() - began
        pids = until(lambda: p if len(p := run.ranks()) == world else None, 30)
        ranks = {pid: at for pid in pids.values() if (at := _started_at(pid)) is not None}
        offset = len(run.log.read_text())
        os.kill(pids[fault.rank], fault.signum)
        figures = _watch(run, tool, fault.rank, time.monotonic(), offset, cap_s)
        return {"start_s": start_s, **figures, "names_rank": figures["named_rank"] == fault.rank}
    finally:
        _stop_all(run, ranks)


def _median(rounds: list[dict], key: str) -> float | None:
    values = [r[key] for r in rounds]
    return None if None in values else round(statistics.median(values), 3)


def run_case(world: int, fault: Fault, rounds: int, cap_s: float) -> dict:
    """Both tools' rounds of one fault, taking turns; their medians and the exit_s ratio."""
    done: dict[str, list[dict]] = {tool: [] for tool in TOOLS}
    for i in range(rounds):
        for tool in TOOLS if i % 2 == 0 else TOOLS[::-1]:
            with tempfile.TemporaryDirectory(prefix="loom-faults-") as root:
                got = one_round(tool, Path(root), world, fault, cap_s)
            done[tool].append({k: round(v, 3) if isinstance(v, float) else v
                               for k, v in got.items()})
            print(f"{signal.Signals(fault.signum).name} rank {fault.rank} of {world}, {tool}, "
                  f"round {i + 1}: {done[tool][-1]}", file=sys.stderr, flush=True)
    case = {"signal": signal.Signals(fault.signum).name, "rank": fault.rank, "world": world}
    for tool, got in done.items():
        case[tool] = {"rounds": got, "median": {k: _median(got, k) for k in TIMINGS},
                      "named_rounds": sum(r["names_rank"] for r in got)}
    loom, peer = (case[tool]["median"]["exit_s"] for tool in TOOLS)
    case["exit_s_ratio"] = None if loom is None or peer is None else round(peer / loom, 2)
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("all", "dead", "stall"), default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--kill-ranks", type=lambda s: [int(k) for k in s.split(",")],
                        help="ranks to SIGKILL in `dead` (default: 0 and world - 1)")
    parser.add_argument("--heartbeat-s", type=float, default=10.0)
    parser.add_argument("--cap-s", type=float, default=120.0)
    args = parser.parse_args()
    if args.world < 2 or not set(args.kill_ranks or ()) <= set(range(args.world)):
        parser.error(f"--world {args.world} needs at least 2 ranks, and --kill-ranks some of "
                     f"0..{args.world - 1}")
    faults = {}
    if args.case in ("all", "dead"):
        for k in args.kill_ranks or sorted({0, args.world - 1}):
            faults[f"dead_rank{k}"] = Fault(signal.SIGKILL, k, args.heartbeat_s)
    if args.case in ("all", "stall"):
        faults["stall_rank1"] = Fault(signal.SIGSTOP, 1, args.heartbeat_s)
    head = {"benchmark": "faults", "date": datetime.datetime.now().isoformat(timespec="minutes"),
            "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
            "rounds": args.rounds, "heartbeat_s": args.heartbeat_s, "cap_s": args.cap_s,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    cases = {name: run_case(args.world, fault, args.rounds, args.cap_s)
             for name, fault in faults.items()}
    print(json.dumps({**head, "cases": cases}))


if __name__ == "__main__":
    main()
