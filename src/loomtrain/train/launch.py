"""Process start-up: torch's elastic launcher on one machine, or joining a torchrun job (one
process runs in place); `loom train`'s signals forwarded to the workers; the parameter
server's own launcher, which outlives a dead worker.

Details: docs/training.md, "Processes"; signals: docs/checkpoints.md, "Signals".
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.comm.link import SlowLink
from loomtrain.mesh import Mesh, build_mesh
from loomtrain.train import messages
from loomtrain.train.stop import SignalForwarding, held_signals


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(cfg_run, local_rank: int) -> torch.device:
    """GPU `local_rank`, or with more ranks than GPUs on the host, `local_rank` modulo their
    number: ranks then share a GPU, which gloo carries (parallel.backend = "gloo": how
    benchmarks/gpu_check.py runs the multi-process paths on one GPU; NCCL refuses two ranks on
    one GPU with its own error)."""
    if cfg_run.device == "cuda" or (cfg_run.device == "auto" and torch.cuda.is_available()):
        index = local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(cfg) -> Mesh:
    """Initialize the default process group (if needed) and build the mesh from [parallel],
    with the simulated inter-node link of [comm] when it is configured."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(cfg.run, local_rank)
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    if not dist.is_initialized():
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # one process, not launched: a private one-rank group
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="loom-"), "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device.type == "cpu":
        # processes on one host share its cores; oversubscribing them slows every rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    p, c = cfg.parallel, cfg.comm
    link = None
    if c.inter_node_gbps is not None:  # config validation guarantees several nodes
        link = SlowLink(c.inter_node_gbps, c.inter_node_latency_ms, p.ranks_per_node,
                        c.link_changes)
    return build_mesh({"pp": p.pp, "dp": p.dp_size, "cp": p.cp, "tp": p.tp, "ep": p.ep},
                      ranks_per_node=p.ranks_per_node, device=device, link=link)


def shutdown(mesh: Mesh | None) -> None:
    """Destroy the process group, after a barrier of the mesh's ranks (none without a mesh).

    A parameter-server run passes no mesh (run.run): its ranks need not and cannot meet
    there. A worker may have died or been replaced by a rejoined process outside the world; the
    barrier then fails at once ("Connection closed by peer": measured, a server that had
    finished and saved exited 4, and so did the surviving workers), or a worker the server
    dropped as hung holds every other rank in it until parallel.timeout_s. Nothing is in flight
    without it: the server returns only once every live worker has read its stop, and the
    receives it keeps posted for lost workers go with the group (measured, gloo: destroy with
    a receive pending from a live peer returns at once; the peer's late send then fails at
    once with "Connection closed by peer")."""
    if dist.is_initialized():
        if mesh is not None and mesh.world > 1:
            # a barrier before destroy avoided an intermittent abort at exit (DESIGN.md)
            from loomtrain.comm import barrier
            barrier(mesh)
        dist.destroy_process_group()


def launch_local(nproc: int, entrypoint, *args) -> dict[int, object]:
    """Run `entrypoint(*args)` on `nproc` local processes via the elastic launcher; returns
    {rank: return value}. Raises torch's ChildFailedError if a worker fails."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.2, start_method="spawn",
    )
    return elastic_launch(config, entrypoint)(*args)


def launch_restarting(nproc: int, entrypoint, payload: tuple, restarts=None) -> None:
    """`launch_local(nproc, entrypoint, *payload)`, launched again with the payload
    `restarts.after(failures, payload)` gives (train/restart.py) after each failure, until it
    gives None: then the failure (ChildFailedError) is raised.

    Restarts are ours, not torch's agent's (LaunchConfig.max_restarts): the agent restarts the
    group after any failure, with the same arguments, while a restart here must not follow a
    deterministic error (exit 2 or 3) nor a stop signal, and must tell the ranks which
    checkpoint to continue from. Each launch is a fresh agent, rendezvous and processes, as the
    agent's own restart would be; the launcher's pid, run-folder lock and error folder stay."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    while True:
        try:
            launch_local(nproc, entrypoint, *payload)
            return
        except ChildFailedError as err:
            payload = None if restarts is None else restarts.after(err.failures, payload)
            if payload is None:
                raise


def _worker_pids() -> list[int]:
    """This process's children (the launcher's workers), less multiprocessing's resource
    tracker, from /proc (Linux)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            # the tracker by its code: a rank's -W options may name the tracker's module too
            tracker = b"resource_tracker import main" in (stat.parent / "cmdline").read_bytes()
            if ppid == os.getpid() and not tracker:
                pids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return pids


class _QuietChildThread(logging.Filter):
    """torch's notes that say nothing to a user of `loom train`: the agent on a thread, and,
    when a rank fails, the agent's traceback of its own join and the ranks it then stops
    (the failing rank's message is printed once by the CLI: train/messages.py)."""

    NOISE = ("running on a child thread", "failed (exitcode", "Terminating process")
    LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(noise in record.getMessage() for noise in self.NOISE)


END_GRACE_S = 1.0  # after a rank has left its error message, for the others to leave theirs


def launch_forwarding_signals(nproc: int, entrypoint, payload: tuple, received: list[int],
                              errors: Path | None = None, restarts=None) -> None:
    """The elastic launcher on a thread, with SIGINT/SIGTERM forwarded to the workers: they
    save a checkpoint at the next step boundary and return normally; a second signal SIGKILLs
    them. `received` collects the signals. `restarts`: the restart rule of run.max_restarts
    (train/restart.Restarts; `launch_restarting`), which sees `received`.

    `errors`: the folder where ranks leave their error messages (run.leave). Once one is
    there the run has failed, and the ranks still running `END_GRACE_S` later are SIGKILLed:
    the agent would send them SIGTERM, which a rank takes as a stop for the next step boundary
    and a stopped (SIGSTOP) or stuck one never acts on, and SIGKILL them only 30 s later
    (measured: a SIGSTOPped rank held the job's end 30 s after its survivors had named it).

    Left on the main thread, torch's elastic agent catches these signals itself, forwards them
    and SIGKILLs the workers 30 s later; a function worker that has returned waits for the
    agent to read its return value, which an agent shutting down never does, so every stop
    ended in SIGKILL after 30 s (measured, torch 2.13; the agent's `signals_to_handle` is not
    reachable through `launch_local`). On a thread the agent installs no handlers. Signals
    that arrive before the workers exist are forwarded once they do; the agent's thread holds
    them blocked (`held_signals`), so the workers it starts keep a signal pending until they
    can act on it. Without /proc (not Linux) the agent keeps the main thread and its own
    handling."""
    if not Path("/proc/self/stat").exists():
        launch_restarting(nproc, entrypoint, payload, restarts)
        return
    outcome: dict[str, BaseException] = {}

    def agent() -> None:  # the ranks of every restart are started from this one thread
        try:
            with held_signals():
                launch_restarting(nproc, entrypoint, payload, restarts)
        except BaseException as err:  # re-raised on the main thread
            outcome["error"] = err

    quiet = _QuietChildThread()
    for name in quiet.LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    thread = threading.Thread(target=agent, name="loom-elastic-agent", daemon=True)
    try:
        with SignalForwarding(received) as signals:
            thread.start()
            failed_at = None
            while thread.is_alive():
                thread.join(0.1)
                signals.forward(_worker_pids)
                failed = errors is not None and any(errors.glob("*.txt"))
                if failed and failed_at is None:
                    failed_at = time.monotonic()
                elif not failed:  # a restart (train/restart.py) clears the messages first
                    failed_at = None
                if failed_at is not None and time.monotonic() - failed_at >= END_GRACE_S:
                    for pid in _worker_pids():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    failed_at = float("inf")  # once per attempt
    finally:
        for name in quiet.LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
    if "error" in outcome:
        raise outcome["error"]


def _tolerant_rank(rank: int, world: int, port: int, entrypoint, payload: tuple) -> None:
    """One rank of `launch_tolerant` (a spawned process): the elastic launcher's environment,
    then the entrypoint; its exit code (0, or what it passed to sys.exit) is the process's.

    The process leaves through os._exit once the entrypoint has returned and the output is
    flushed, skipping the interpreter's teardown: there a server that had dropped a hung
    worker (whose receive stays posted, asyncsgd/server.py) and served a rejoined one was
    aborted by gloo ("terminate called without an active exception", SIGABRT) after the run
    had finished and saved, in 3 of 8 runs (measured, torch 2.13), turning its exit 0 into -6;
    cli.entry does the same for failure codes. Everything the run writes is closed by then.
    An exception other than SystemExit leaves as usual (traceback, exit code 1). The rank
    starts with the stop signals blocked (launch_tolerant's `held_signals`)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        code = int(entrypoint(*payload) or 0)
    except SystemExit as stop:  # train_worker's exit codes for people: 2, 3, 4
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def say(line: str) -> None:
    """One line from the launcher to the user, on stderr."""
    print(f"loom: {line}", file=sys.stderr, flush=True)


def exit_text(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def launch_tolerant(nproc: int, entrypoint, payload: tuple, received: list[int],
                    grace_s: float, run_dir: Path, servers: int = 1,
                    errors: Path | None = None) -> None:
    """`entrypoint(*payload)` on `nproc` local processes of a parameter-server run (`[async]
    mode = "ps"`: ranks 0..servers-1 the servers, the others its workers), in which a worker's
    death does not end the run. The elastic launcher stops every process when one fails; here the ranks are
    spawned and watched by this function instead.

    - Each rank gets what the elastic launcher would give it (RANK, WORLD_SIZE, LOCAL_RANK,
      LOCAL_WORLD_SIZE, MASTER_ADDR = 127.0.0.1, a free MASTER_PORT; rank 0 hosts the store),
      so `init_distributed`'s env:// path is the same. Start method spawn.
    - SIGINT/SIGTERM are forwarded as by `launch_forwarding_signals` (`stop.SignalForwarding`):
      the first to every live rank (the server saves and stops the workers), a second SIGKILLs.
    - The ranks' pids are printed once on stderr. A worker that exits abnormally is reported in
      one line there (its index, rank, pid, exit code or signal, the message it left in
      `errors` if it left one (train/messages.py), and how to restart it in `run_dir`); the
      others go on. The server drops it (gloo reports the closed
      connection at once: asyncsgd/server.py) and `loom train --rejoin` may take its place.
    - The outcome is rank 0's. When it has ended normally, the surviving workers (already
      stopping: the server returns only once every live worker has read its stop, and one it
      dropped fails at its next message to the gone server) get `grace_s` to end, and are then
      SIGKILLed. If it fails, the workers are SIGKILLed at once (a worker holds nothing to
      save) and ChildFailedError is raised with rank 0's exit code, as the elastic path
      raises it (for the CLI's exit code). With sharded servers (`servers` > 1), any server
      rank that exits abnormally fails the run the same way: its slice of the parameters is
      gone, so the workers could not go on."""
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [ctx.Process(target=_tolerant_rank, args=(rank, nproc, port, entrypoint, payload),
                         name=f"loom-rank-{rank}") for rank in range(nproc)]
    server, reported = ranks[0], set()
    shards = ranks[1:servers]  # sharded servers besides rank 0: each one's failure is the run's
    deadline = None  # for the workers, once the server has ended

    def live() -> list:
        return [p for p in ranks if p.exitcode is None]

    with SignalForwarding(received) as signals:
        try:
            with held_signals():  # the ranks act on a stop once they can: stop.py
                for p in ranks:
                    p.start()
            say(f"ranks started as pids {[p.pid for p in ranks]} (ranks 0..{servers - 1}: the "
                f"parameter server{'s' if servers > 1 else ''}; rank r: worker r - {servers})")
            while live():
                wait([p.sentinel for p in live()], timeout=0.1)
                signals.forward(lambda: [p.pid for p in live()])
                failed_shard = next((p for p in shards if p.exitcode not in (None, 0)), None)
                if failed_shard is not None:
                    server = failed_shard  # the run's outcome: every rank is killed below
                    deadline = time.monotonic()
                for rank, p in enumerate(ranks[servers:], servers):  # once the server ended,
                    if (p.exitcode not in (None, 0) and rank not in reported  # it is the news
                            and server.exitcode is None and not signals.killed):
                        reported.add(rank)
                        said = messages.take(errors, p.pid) if errors is not None else None
                        say(f"worker {rank - servers} (rank {rank}, pid {p.pid}) "
                            f"{exit_text(p.exitcode)}{f' ({said})' if said else ''}; "
                            f"the parameter server and the other "
                            f"workers go on (`loom train --rejoin {run_dir} --worker "
                            f"{rank - servers}` restarts it)")
                if server.exitcode is not None and deadline is None:
                    deadline = time.monotonic() + (grace_s if server.exitcode == 0 else 0.0)
                if deadline is not None and time.monotonic() >= deadline:
                    for rank, p in enumerate(ranks[servers:], servers):
                        if p.exitcode is None and server.exitcode == 0:
                            say(f"worker {rank - servers} (rank {rank}, pid {p.pid}) had not ended "
                                f"{grace_s:g} s after the server (parallel.timeout_s): killed")
                    break
        finally:  # the ranks never outlive the launcher
            for p in live():
                p.kill()
                p.join()
    if server.exitcode != 0:
        raise child_failed(entrypoint, ranks.index(server), server)


def child_failed(entrypoint, rank: int, process):
    """The ChildFailedError the elastic path raises for `process` (rank `rank`) that exited
    abnormally: the CLI reads its exit code from it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=rank, pid=process.pid, exitcode=process.exitcode,
                             error_file="")
    return ChildFailedError(getattr(entrypoint, "__name__", "loom"), {rank: failure})
