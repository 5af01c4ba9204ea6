"""A run on one rank: `train_worker(cfg_dict, run_dir, resume)`, the entry point of every
launched process; `run`, which joins the mesh, trains and leaves it; and `train_loop`, which
hands the run to its mode's loop: the parameter server's (`async.mode = "ps"`,
asyncsgd/train.py), the zeroth-order one (`optim.name` other than "backprop", zeroth/train.py)
or backprop's (train/trainer.py). The three loops share the trainer's pieces; this module sits
above them, so none of them imports another's mode.
"""

from __future__ import annotations

from pathlib import Path

from loomtrain import comm
from loomtrain.errors import UserError
from loomtrain.train.config import Config, config_from_dict
from loomtrain.train.launch import init_distributed, shutdown
from loomtrain.train.backprop import train_backprop
from loomtrain.train.trainer import NonFiniteError, StopFlag


def run(cfg: Config, run_dir: Path, resume: Path | None, on_cause=None) -> int:
    """This rank's run, from joining the mesh to leaving it. `on_cause(text, code)`: what the
    heartbeat calls, on its own thread, once it has named the rank holding up this one (a
    stalled, dead or mismatched peer: comm/heartbeat.py); it must end the process. None: the
    finding becomes the message of the collective's own failure (parallel.timeout_s)."""
    stop = StopFlag()
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
        code, text, cause = ending(err) or (1, "", False)
        if beat is not None and cause:
            beat.leave(text, code)  # the peers whose ops fail now end on this text
        # no exit barrier: a failed collective means a peer may be gone, and the barrier
        # would wait for it until parallel.timeout_s (measured: a rank 0 SIGKILLed mid-run
        # held the survivors there until the launcher's SIGKILL 30 s later)
        shutdown(None)
        raise
    finally:
        if beat is not None:
            beat.stop()
    return code


def ending(err: BaseException) -> tuple[int, str, bool] | None:
    """How a rank ends on `err`: (exit code, message, whether the message names the cause),
    for the errors meant for people; None for any other (a crash: its traceback). A failed
    collective names its cause when the heartbeat found one; otherwise it is a consequence of
    something another rank says better."""
    if isinstance(err, UserError):
        return 2, str(err), True
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
                 launcher_pid: int | None = None, folder_lock=None, errors: str | None = None
                 ) -> int:
    """Entry point of every launched process (picklable: module level, plain arguments).
    `launcher_pid`: the `loom train` that started this rank, which it must not outlive
    (train/orphan.py); `folder_lock`: that launcher's run-folder lock (train/runlock.py),
    held by this process as an inherited descriptor until it exits; `errors`: a folder where
    this rank leaves its error message for the launcher to print once (`report_errors`),
    instead of printing it itself."""
    if launcher_pid is None:
        return _worker(cfg_dict, run_dir, resume, errors)
    from loomtrain.train.orphan import ending_with_launcher

    with ending_with_launcher(launcher_pid, cfg_dict["parallel"]["timeout_s"]):
        return _worker(cfg_dict, run_dir, resume, errors)


def _worker(cfg_dict: dict, run_dir: str, resume: str | None, errors: str | None) -> int:
    import sys

    def on_cause(text: str, code: int) -> None:  # the heartbeat's thread
        leave(errors, text, code, cause=True)

    try:
        return run(config_from_dict(cfg_dict), Path(run_dir), Path(resume) if resume else None,
                   on_cause)
    except (UserError, NonFiniteError, comm.CollectiveError) as err:
        # a message for people, not a traceback; the launcher then stops the other ranks
        code, text, cause = ending(err)
        if errors is None:
            print(f"error: {text}", file=sys.stderr, flush=True)
            sys.exit(_process_code(code))
        leave(errors, text, code, cause)


def _process_code(code: int) -> int:
    """A rank that ends on a message exits 2, 3 or 4; a message about a peer that died
    without one calls for the job's exit code 1 (a crash), which this rank's own exit code
    must not claim: the launcher would take this rank for the crashed one."""
    return code if code in (2, 3, 4) else 4


def leave(errors: str | None, text: str, code: int, cause: bool):
    """End this process (from any thread) on `text`, which calls for exit code `code`: left in
    `errors` for the launcher (`report_errors`; `cause`: it names the cause, not a
    consequence), or printed when there is no such folder. Never returns."""
    import os
    import sys

    if errors is None:
        print(f"error: {text}", file=sys.stderr, flush=True)
    else:
        partial = Path(errors) / f"{os.getpid()}.{code}.{'cause' if cause else 'after'}.partial"
        partial.write_text(text)
        os.replace(partial, partial.with_suffix(".txt"))  # whole, or not there
    # without the interpreter's teardown, where gloo may abort a rank whose peers are gone
    # ("terminate called without an active exception": exit -6 instead of this code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_process_code(code))


def report_errors(errors: Path) -> int | None:
    """Print the messages the ranks left in `errors`, each distinct one once, first come
    first: those that name a cause, or, when none does, the others (a failed collective's
    consequences). Returns the exit code the first printed calls for; None if there was none."""
    import sys

    found = []
    for path in sorted(errors.glob("*.txt"), key=lambda p: p.stat().st_mtime):
        _pid, code, kind = path.stem.split(".")
        found.append((kind == "cause", int(code), path.read_text()))
    shown = [f for f in found if f[0]] or found
    for text in dict.fromkeys(text for _, _, text in shown):
        print(f"error: {text}", file=sys.stderr, flush=True)
    return shown[0][1] if shown else None
