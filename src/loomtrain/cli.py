"""The `loom` command: `loom train | report | export`.

User errors (config, data, checkpoints) print one paragraph on stderr and exit with code 2;
nothing already written in a run folder is touched before the input is validated.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loomtrain.errors import CheckpointError, ConfigError, UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (default: the small GPT on the stdlib corpus)")
    train.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")
    train.add_argument("--nproc", type=int, help="processes on this machine (parallel.nproc)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    train.add_argument("--dry-run", action="store_true",
                       help="resolve the config and build the mesh without training; print layout, memory and collectives")

    report = sub.add_parser("report", help="plot a run's metrics into RUN_DIR/report.png")
    report.add_argument("run_dir")

    export = sub.add_parser("export", help="consolidate a run's latest checkpoint into one file")
    export.add_argument("run_dir")
    export.add_argument("--to", choices=["safetensors"], default="safetensors")
    export.add_argument("--out", help="output file (default: RUN_DIR/model.safetensors)")
    return parser


def _unique_run_dir(cfg) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... if taken: a new run never writes into an old one."""
    base = Path(cfg.run.dir) / cfg.run.name
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _resolve_train(args):
    from loomtrain.train import checkpoint
    from loomtrain.train.config import load_config

    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"parallel.nproc={args.nproc}")
    if args.resume:
        run_dir = Path(args.resume)
        if args.config:
            raise ConfigError("give either a CONFIG or --resume RUN_DIR (which uses RUN_DIR/config.toml), not both")
        if not (run_dir / "config.toml").is_file():
            raise CheckpointError(f"--resume {str(run_dir)!r}: no config.toml there; is it a loom run folder?")
        cfg = load_config(run_dir / "config.toml", overrides)
        done = checkpoint.list_checkpoints(run_dir)
        if not done:
            raise CheckpointError(f"--resume {str(run_dir)!r}: no complete checkpoint in {run_dir / 'checkpoints'}")
        latest = done[-1]
        world = checkpoint.read_meta(latest).get("world")
        if world != cfg.parallel.nproc:
            raise CheckpointError(
                f"checkpoint {str(latest)!r} was written by {world} ranks, but parallel.nproc="
                f"{cfg.parallel.nproc}; resume with --nproc {world}")
        return cfg, run_dir, latest
    cfg = load_config(args.config, overrides)
    return cfg, None, None


def cmd_train(args) -> int:
    from loomtrain.train.config import config_to_toml
    from loomtrain.train.launch import in_torchrun, launch_local
    from loomtrain.train.trainer import train_worker

    cfg, run_dir, resume = _resolve_train(args)
    if args.dry_run:
        from loomtrain.train.dryrun import dry_run
        print(dry_run(cfg))
        return 0
    from loomtrain.data import load_corpus
    load_corpus(cfg.data.source, cfg.data.val_fraction, cfg.model.vocab_size)  # fail before spawning
    if in_torchrun():
        run_dir = run_dir or Path(cfg.run.dir) / cfg.run.name  # every node must name the same folder
        if int(os.environ["WORLD_SIZE"]) != cfg.parallel.nproc:
            raise ConfigError(
                f"parallel.nproc={cfg.parallel.nproc} but torchrun started WORLD_SIZE="
                f"{os.environ['WORLD_SIZE']} processes; set --nproc {os.environ['WORLD_SIZE']}")
    else:
        run_dir = run_dir or _unique_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("RANK", 0)) == 0:
        tmp = run_dir / "config.toml.tmp"
        tmp.write_text(config_to_toml(cfg))
        os.replace(tmp, run_dir / "config.toml")
        print(f"run folder: {run_dir}", file=sys.stderr)
    payload = (cfg.model_dump(), str(run_dir), str(resume) if resume else None)
    if in_torchrun() or cfg.parallel.nproc == 1:
        return train_worker(*payload)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    try:
        launch_local(cfg.parallel.nproc, train_worker, *payload)
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        print(f"error: a worker failed (exit codes {sorted(codes)}); see its message above",
              file=sys.stderr)
        return 2 if 2 in codes else 1
    return 0


def cmd_report(args) -> int:
    from loomtrain.report import write_report
    print(write_report(Path(args.run_dir)))
    return 0


def cmd_export(args) -> int:
    from loomtrain.train.export import export_safetensors
    print(export_safetensors(Path(args.run_dir), Path(args.out) if args.out else None))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"train": cmd_train, "report": cmd_report, "export": cmd_export}[args.command](args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
