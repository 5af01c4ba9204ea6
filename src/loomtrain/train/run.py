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


def run(cfg: Config, run_dir: Path, resume: Path | None) -> int:
    stop = StopFlag()
    mesh = init_distributed(cfg)
    try:
        return train_loop(cfg, run_dir, resume, mesh, stop)
    finally:
        shutdown(None if cfg.asgd.mode == "ps" else mesh)  # no exit barrier: launch.shutdown


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
    import os

    from loomtrain.train.orphan import ending_with_launcher
    from loomtrain.train.restart import name_rank

    name_rank(int(os.environ["RANK"]))  # its launcher tells which rank ended by this name

    with ending_with_launcher(launcher_pid, cfg_dict["parallel"]["timeout_s"]):
        return _worker(cfg_dict, run_dir, resume, errors)


def _worker(cfg_dict: dict, run_dir: str, resume: str | None, errors: str | None) -> int:
    import sys

    try:
        return run(config_from_dict(cfg_dict), Path(run_dir), Path(resume) if resume else None)
    except (UserError, NonFiniteError, comm.CollectiveError) as err:
        # a message for people, not a traceback; the launcher then stops the other ranks
        code = 2 if isinstance(err, UserError) else 3 if isinstance(err, NonFiniteError) else 4
        if errors is None:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(code)
        import os

        partial = Path(errors) / f"{os.getpid()}-{code}.partial"  # restart.left_codes
        partial.write_text(str(err))
        os.replace(partial, partial.with_suffix(".txt"))  # whole, or not there
        # without the interpreter's teardown, where gloo may abort a rank whose peers are gone
        # ("terminate called without an active exception": exit -6 instead of this code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def report_errors(errors: Path) -> bool:
    """Print each distinct message the ranks left in `errors` once, first come first; whether
    there was any."""
    import sys

    texts = [p.read_text() for p in sorted(errors.glob("*.txt"), key=lambda p: p.stat().st_mtime)]
    for text in dict.fromkeys(texts):
        print(f"error: {text}", file=sys.stderr, flush=True)
    return bool(texts)
