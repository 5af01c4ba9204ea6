"""A run on one rank: `train_worker(cfg_dict, run_dir, resume)`, the entry point of every
launched process; `run`, which joins the mesh, trains and leaves it; and `train_loop`, which
hands the run to its mode's loop: the parameter server's (`async.mode = "ps"`,
asyncsgd/train.py), the zeroth-order one (`optim.name` other than "backprop", zeroth/train.py)
or backprop's (train/trainer.py). The three loops share the trainer's pieces; this module sits
above them, so none of them imports another's mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

from loomtrain import comm
from loomtrain.errors import UserError, WriteError
from loomtrain.train import checkpoint, messages
from loomtrain.train.config import Config, config_from_dict
from loomtrain.train.launch import init_distributed, shutdown
from loomtrain.train.backprop import train_backprop
from loomtrain.train.stop import StopFlag, ignore_stops
from loomtrain.train.trainer import NonFiniteError
from loomtrain.writes import STORAGE_ERRNOS, write_error


def run(cfg: Config, run_dir: Path, resume: Path | None, stop: StopFlag | None = None,
        seat=None, on_cause=None) -> int:
    """This rank's run, from joining the mesh to leaving it (`stop`: the flag it acts on; one
    is installed here if not given). `seat`: a replica of a run that outlives lost ones
    (lowcomm/replica_train.py), which joins and leaves its groups itself. `on_cause(text,
    code)`: what the heartbeat calls, on its own thread, once it has named the rank holding up
    this one (a stalled, dead or mismatched peer: comm/heartbeat.py); it must end the process.
    None: the finding becomes the message of the collective's own failure (parallel.timeout_s)."""
    stop = stop if stop is not None else StopFlag()
    if seat is not None:
        from loomtrain.lowcomm.replica_train import run_replica

        return run_replica(cfg, run_dir, resume, seat, stop)
    mesh = init_distributed(cfg)
    beat = None
    if mesh.world > 1 and cfg.parallel.heartbeat_timeout_s > 0 and cfg.asgd.mode != "ps":
        # not in a parameter-server run: its server drops a lost worker and goes on
        from loomtrain.comm.heartbeat import start_heartbeat
        beat = start_heartbeat(mesh, cfg.parallel.heartbeat_timeout_s, on_cause)
    try:
        code = train_loop(cfg, run_dir, resume, mesh, stop)
        shutdown(None if cfg.asgd.mode == "ps" else mesh)  # no exit barrier: launch.shutdown
    except BaseException as err:
        code, text, cause = ending(err, run_dir) or (1, "", False)
        if beat is not None and text:
            # the peers whose ops fail now end on a cause; a consequence tells them that this
            # rank, gone in a moment, did not die
            beat.leave(text, code, cause)
        # no exit barrier: a failed collective means a peer may be gone, and the barrier
        # would wait for it until parallel.timeout_s (measured: a rank 0 SIGKILLed mid-run
        # held the survivors there until the launcher's SIGKILL 30 s later); an error of this
        # rank alone (a write that failed) leaves its peers in another collective, which the
        # barrier would report as the error instead of the real one
        shutdown(None)
        raise
    finally:
        if beat is not None:
            beat.stop()
    return code


def ending(err: BaseException, run_dir: Path) -> tuple[int, str, bool] | None:
    """How a rank ends on `err`: (exit code, message, whether the message names the cause),
    for the errors meant for people; None for any other (a crash: its traceback). A failed
    collective names its cause when the heartbeat found one; otherwise it is a consequence of
    something another rank says better. A write error (or an OSError of the disk's that no
    write site named) says what the run folder still holds."""
    if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
        return 2, _for_people(err, run_dir), True
    if isinstance(err, UserError):
        return 2, _for_people(err, run_dir), True
    if isinstance(err, NonFiniteError):
        return 3, str(err), True
    if isinstance(err, comm.CollectiveError):
        return err.code, str(err), err.named
    return None


def train_loop(cfg: Config, run_dir: Path, resume: Path | None, mesh, stop: StopFlag) -> int:
    """This rank's part of the run on `mesh`, by the config's mode. The technique loops are
    imported when chosen: a backprop run loads neither."""
    if cfg.asgd.mode == "ps":  # rank 0 serves parameters, ranks 1.. compute gradients
        from loomtrain.asyncsgd.train import train_async

        return train_async(cfg, run_dir, resume, mesh, stop)
    if cfg.optim.name != "backprop":  # zeroth-order: forward passes only, no engine
        from loomtrain.zeroth.train import train_zeroth

        return train_zeroth(cfg, run_dir, resume, mesh, stop)
    return train_backprop(cfg, run_dir, resume, mesh, stop)


def train_worker(cfg_dict: dict, run_dir: str, resume: str | None,
                 launcher_pid: int | None = None, folder_lock=None, errors: str | None = None,
                 seat=None, stop: StopFlag | None = None) -> int:
    """Entry point of every launched process (picklable: module level, plain arguments).
    `launcher_pid`: the `loom train` that started this rank, which it must not outlive
    (train/orphan.py); `folder_lock`: that launcher's run-folder lock (train/runlock.py),
    held by this process as an inherited descriptor until it exits; `errors`: a folder where
    this rank leaves its error message for the launcher to print once (train/messages.py),
    instead of printing it itself; `seat`: this process's place among the replicas of a run
    that outlives lost ones (train/replica_launch.py); `stop`: the flag `loom train` installed
    at its start, when the rank runs in that process (nproc 1, torchrun). A launched rank
    installs its own first thing: it was started with the stop signals blocked
    (stop.held_signals), and one that came meanwhile is acted on from here."""
    stop = stop if stop is not None else StopFlag()
    if launcher_pid is None:
        return _worker(cfg_dict, run_dir, resume, errors, stop, seat)
    import os

    from loomtrain.train.orphan import ending_with_launcher
    from loomtrain.train.restart import name_rank

    name_rank(int(os.environ["RANK"]))  # its launcher tells which rank ended by this name

    with ending_with_launcher(launcher_pid, cfg_dict["parallel"]["timeout_s"]):
        try:
            code = _worker(cfg_dict, run_dir, resume, errors, stop, seat)
        except Exception:  # a bug: its traceback, for the launcher to print once
            if errors is not None:
                messages.keep_traceback(errors, int(os.environ["RANK"]))
            raise
    ignore_stops()
    return code


def _worker(cfg_dict: dict, run_dir: str, resume: str | None, errors: str | None,
            stop: StopFlag, seat=None) -> int:
    def on_cause(text: str, code: int) -> None:  # the heartbeat's thread
        messages.leave(errors, code, text, cause=True)

    try:
        return run(config_from_dict(cfg_dict), Path(run_dir), Path(resume) if resume else None,
                   stop, seat, on_cause)
    except (UserError, NonFiniteError, comm.CollectiveError, OSError) as err:
        found = ending(err, Path(run_dir))
        if found is None:
            raise  # not the disk's: a bug, with its traceback
        # a message for people, not a traceback; the launcher then stops the other ranks
        code, text, cause = found
        if errors is None:  # one process (nproc 1) or torchrun: its own message, its code
            print(f"error: {text}", file=sys.stderr, flush=True)
            return messages.process_code(code)
        messages.leave(errors, code, text, cause)


def _for_people(err: Exception, run_dir: Path) -> str:
    """The error's paragraph; a write error's says what the run folder still holds."""
    if isinstance(err, OSError):  # one no write site named (they raise WriteError)
        err = write_error(err.filename or "a file of the run", err)
    if not isinstance(err, WriteError):
        return str(err)
    saved = checkpoint.list_checkpoints(run_dir)
    if not saved:
        return f"{err}. No checkpoint had been saved"
    return (f"{err}. The newest checkpoint, {saved[-1].name}, is complete and untouched: make "
            f"room (or fix the folder), then continue with: loom train --resume {run_dir}")
