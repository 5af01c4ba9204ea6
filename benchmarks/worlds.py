"""What the benchmarks that compare engines share: one world of spawned gloo ranks per engine,
idle between commands, and the process measurements they read.

Each engine trains in its own world, one engine per process, so peak resident memory can be
told apart; the worlds take turns, the idle ones blocked on a queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import queue
import resource
import socket
import statistics
import sys
import time

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException


def import_peer(module: str, benchmark: str):
    """The peer library `benchmark` measures against; where it cannot be imported, one line on
    stderr saying so and how to install it (the `peers` extra), and exit 2."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        print(f"{benchmark}: its peer {module} cannot be imported ({err}); install the peers "
              'with pip install -e ".[peers]"', file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes() -> int:
    """Resident set size now (Linux /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wchar_bytes() -> int:
    """Bytes this process (all its threads) handed to write()/writev() so far (/proc/self/io):
    gloo's TCP transport sends so, and so does every other socket and file writer."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Restart the peak at the current RSS (Linux >= 4.0: "5" to /proc/self/clear_refs resets
    the high-water mark that ru_maxrss reads); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def pin_mmap_threshold(kib: int) -> None:
    """Serve every allocation of `kib` KiB or more with its own mmap, returned to the kernel
    when freed, so RSS follows the live tensors. glibc's default threshold is dynamic: it
    rises (up to 32 MiB) to the size of the largest mmapped block freed, after which freed
    block-sized tensors stay in its heap, reused or not; measured here on stage 3, that kept
    ~160 MiB more resident per rank after 6 steps, still growing, and less on other engines.
    Setting the threshold also turns the dynamic rule off (mallopt(3))."""
    if kib and not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, kib * 1024):
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {kib} KiB) failed")


class World:
    """`nprocs` spawned ranks running `target(rank, *args, commands, results)`: the rank reads
    its commands from `commands[rank]` (None: stop) and puts `(rank, result)` on `results`."""

    def __init__(self, name: str, nprocs: int, target, args: tuple, timeout_s: float):
        ctx = mp.get_context("spawn")
        self.name, self.nprocs, self.timeout_s = name, nprocs, timeout_s
        self.commands = [ctx.SimpleQueue() for _ in range(nprocs)]
        self.results = ctx.Queue()
        self.procs = mp.start_processes(target, args=(*args, self.commands, self.results),
                                        nprocs=nprocs, join=False, start_method="spawn")

    def collect(self) -> dict[int, dict]:
        """Every rank's next result; fails if a rank dies or nothing comes within the timeout."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < self.nprocs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no result within {self.timeout_s} s")
            try:
                rank, result = self.results.get(timeout=1.0)
                got[rank] = result
            except queue.Empty:
                self.procs.join(timeout=0.01)  # raises if a rank failed
        return got

    def command(self, command) -> dict[int, dict]:
        for q in self.commands:
            q.put(command)
        return self.collect()

    def close(self) -> None:
        """Stop the ranks (every result was collected before). A rank that aborts as it
        leaves the process group (SIGABRT: "terminate called without an active exception",
        an intermittent abort in torch's teardown despite the barrier before destroy,
        DESIGN.md; seen once in a local suite run on 2026-12-06, benchmarks/zero.py --small)
        is reported on stderr, not raised: its figures were all delivered."""
        for q in self.commands:
            q.put(None)
        deadline = time.monotonic() + self.timeout_s
        try:
            while not self.procs.join(timeout=1.0):  # one call returns after any rank exits
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: ranks did not exit within {self.timeout_s} s")
        except ProcessExitedException as err:
            if err.signal_name != "SIGABRT":
                raise
            print(f"warning: {self.name}: rank {err.error_index} aborted (SIGABRT) while leaving "
                  "the process group, after its last result: the figures are complete",
                  file=sys.stderr, flush=True)

    def kill(self) -> None:
        for proc in self.procs.processes:
            if proc.is_alive():
                proc.kill()


@contextlib.contextmanager
def closing_worlds(worlds: dict[str, World]):
    """Close every world of `worlds` (filled inside the block) at its end; on any error kill
    them all instead, so that a failed or hung world never outlives the run."""
    try:
        yield worlds
        for world in worlds.values():
            world.close()
    except BaseException:
        # a rank that fails while its world closes must not leave another world's ranks
        # waiting on their queues: the parent would wait for them at exit, forever
        for world in worlds.values():
            world.kill()
        raise


def take_turns(worlds: dict[str, World], rounds: int, steps: int, label: str,
               start: float) -> tuple[dict, dict]:
    """Two engines' worlds, set up side by side: their first results, then `rounds` rounds of
    ("round", steps) each, in turns A B, B A, ... so that a drift of the machine's load falls
    on both alike. Returns (rounds per engine, each round's result from rank 0 with the peak
    memory the max over ranks; per engine its first step's loss and whether every rank's
    peak was reset after set-up)."""
    first = {e: w.collect() for e, w in worlds.items()}
    engines = list(worlds)
    done: dict[str, list[dict]] = {e: [] for e in engines}
    for i in range(rounds):
        for e in engines if i % 2 == 0 else engines[::-1]:
            got = worlds[e].command(("round", steps))
            r = dict(got[0], peak_mem_bytes=max(g["peak_mem_bytes"] for g in got.values()))
            done[e].append(r)
            print(f"{label}round {i + 1}/{rounds} {e:>15}: {r['tokens_per_s']:7.1f} tok/s, "
                  f"step {r['step_s']:5.2f} s, peak {r['peak_mem_bytes'] / 2**20:6.0f} MiB "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return done, {e: {"first_step_loss": f[0]["first_step_loss"],
                      "peak_reset": all(r["peak_reset"] for r in f.values())}
                  for e, f in first.items()}


def pair_figures(rounds: dict, first: dict, ours: str, theirs: str) -> dict:
    """`take_turns`' results as figures: per engine the median tokens/s, the peak memory (the
    last round's: it only grows), the first- and last-step losses and the tokens/s of every
    round; "ratio", the median over rounds of ours / theirs (round i of both ran next to each
    other), "mem_ratio" and the first step's relative loss difference."""
    out = {}
    for e in (ours, theirs):
        out[f"{e}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rounds[e])
        out[f"{e}_peak_mem_bytes"] = rounds[e][-1]["peak_mem_bytes"]
        out[f"{e}_first_step_loss"] = first[e]["first_step_loss"]
        out[f"{e}_last_step_loss"] = rounds[e][-1]["last_step_loss"]
        out[f"{e}_per_round_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in rounds[e]]
    out["ratio"] = statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                     for a, b in zip(rounds[ours], rounds[theirs]))
    out["mem_ratio"] = out[f"{ours}_peak_mem_bytes"] / out[f"{theirs}_peak_mem_bytes"]
    ref = first[theirs]["first_step_loss"]
    out["first_step_loss_rel_diff"] = abs(first[ours]["first_step_loss"] - ref) / ref
    return out


def serve_commands(rank: int, commands, results, handlers: dict) -> None:
    """A rank's loop: answer each (kind, arg) command from the parent with
    `handlers[kind](arg)` until the parent sends None."""
    while (command := commands[rank].get()) is not None:
        kind, arg = command
        results.put((rank, handlers[kind](arg)))


@contextlib.contextmanager
def joined_world(rank: int, world: int, port: int, timeout_s: float = 120.0):
    """Join a gloo world of `world` ranks on loopback, with one torch thread in this rank;
    leave it at the end of the block."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def tp_rank(rank: int, world: int, port: int, measure, commands, results) -> None:
    """A `World` target for benchmarks measured inside one gloo world: join it on loopback
    (one torch thread per rank), build a mesh whose tp axis is the world, and answer each
    command (keyword arguments) with `measure(rank, world, mesh=mesh, **command)`.
    `measure` must be importable (module level)."""
    from loomtrain.mesh import build_mesh

    with joined_world(rank, world, port):
        mesh = build_mesh({"tp": world})
        while (kwargs := commands[rank].get()) is not None:
            results.put((rank, measure(rank, world, mesh=mesh, **kwargs)))
