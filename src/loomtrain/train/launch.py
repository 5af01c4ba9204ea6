"""Process start-up: torch's elastic launcher on one machine, or joining a torchrun job.

- `loom train` outside torchrun spawns `parallel.nproc` workers through
  `torch.distributed.launcher.api.elastic_launch` (c10d rendezvous on 127.0.0.1, no restarts).
- Under `torchrun ... -m loomtrain train CONFIG` the environment (RANK, WORLD_SIZE,
  MASTER_ADDR, ...) already describes the job; the worker joins it.
- One process (nproc = 1) runs in place on a one-rank gloo group, so the single-process oracle
  uses the same code path as every parallel run.
- `loom train`'s own SIGINT/SIGTERM go to the workers (`launch_forwarding_signals`), which save
  a checkpoint at the next step boundary and exit normally.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import tempfile
import threading
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.comm.link import SlowLink
from loomtrain.mesh import Mesh, build_mesh


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(cfg_run, local_rank: int) -> torch.device:
    if cfg_run.device == "cuda" or (cfg_run.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
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
    return build_mesh({"pp": p.pp, "dp": p.dp_size, "cp": p.cp, "tp": p.tp},
                      ranks_per_node=p.ranks_per_node, device=device, link=link)


def shutdown(mesh: Mesh | None) -> None:
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


def _worker_pids() -> list[int]:
    """This process's children (the launcher's workers), less multiprocessing's resource
    tracker, from /proc (Linux)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and b"resource_tracker" not in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return pids


class _QuietChildThread(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "running on a child thread" not in record.getMessage()


def launch_forwarding_signals(nproc: int, entrypoint, payload: tuple, received: list[int]) -> None:
    """The elastic launcher on a thread, with SIGINT/SIGTERM forwarded to the workers: they
    save a checkpoint at the next step boundary and return normally; a second signal SIGKILLs
    them. `received` collects the signals.

    Left on the main thread, torch's elastic agent catches these signals itself, forwards them
    and SIGKILLs the workers 30 s later; a function worker that has returned waits for the
    agent to read its return value, which an agent shutting down never does, so every stop
    ended in SIGKILL after 30 s (measured, torch 2.13; the agent's `signals_to_handle` is not
    reachable through `launch_local`). On a thread the agent installs no handlers. Signals
    that arrive before the workers exist are forwarded once they do. Without /proc (not
    Linux) the agent keeps the main thread and its own handling."""
    if not Path("/proc/self/stat").exists():
        launch_local(nproc, entrypoint, *payload)
        return
    outcome: dict[str, BaseException] = {}

    def agent() -> None:
        try:
            launch_local(nproc, entrypoint, *payload)
        except BaseException as err:  # re-raised on the main thread
            outcome["error"] = err

    pending: list[int] = []
    forwarded = 0

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        pending.append(signum)

    quiet = _QuietChildThread()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(quiet)
    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=agent, name="loom-elastic-agent", daemon=True)
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            pids = _worker_pids() if pending else []
            if pending and pids:
                signum = signal.SIGKILL if forwarded or len(pending) > 1 else pending[0]
                pending.clear()
                forwarded += 1
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signum)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").removeFilter(quiet)
    if "error" in outcome:
        raise outcome["error"]
