"""The `loom` command: `loom train | plan | report | export | generate | tokenize | bench`.

User errors (config, data, checkpoints) print one paragraph on stderr and exit with code 2;
nothing already written in a run folder is touched before the input is validated.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
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
    train.add_argument("--skip-damaged", action="store_true",
                       help="with --resume: if the latest checkpoint is damaged, resume from the newest "
                       "intact one (a line names each one skipped and why)")
    train.add_argument("--max-restarts", type=int, metavar="N",
                       help="restart the ranks up to N times after one dies, resuming from the newest "
                       "checkpoint (run.max_restarts; docs/checkpoints.md)")
    train.add_argument("--plan", choices=["none", "auto"],
                       help='parallel.plan: "auto" plans the layout for nproc and runs the best (docs/planner.md)')
    train.add_argument("--dry-run", action="store_true",
                       help="resolve the config and build the mesh without training; print layout, memory and collectives")
    train.add_argument("--rejoin", metavar="RUN_DIR",
                       help='restart a lost worker of the running async.mode="ps" run in RUN_DIR (with --worker)')
    train.add_argument("--worker", type=int, metavar="W", help="the worker index (0..nproc-2) --rejoin restarts")

    plan = sub.add_parser("plan", help="rank parallel plans of a model on a cluster by the cost model (docs/planner.md)")
    plan.add_argument("--model", required=True, metavar="NAME|CONFIG",
                      help="a preset (gpt3-125m .. gpt3-175b, gpt-1t, default) or a loomtrain config file")
    plan.add_argument("--gpus", type=int, required=True, help="devices in the cluster")
    plan.add_argument("--gpu", default="h100-80g", metavar="KIND",
                      help="a100-40g, a100-80g, h100-80g, h200-141g, cpu-here (after `loom bench calibrate`) or a TOML spec")
    plan.add_argument("--gpus-per-node", type=int, help="devices per node (default 8; cpu-here: all)")
    plan.add_argument("--inter-node-gbps", type=float, help="network bandwidth per device in Gbit/s (default: the kind's)")
    plan.add_argument("--global-batch", type=int, help="sequences per step (default: the config's, or the preset's paper value)")
    plan.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    plan.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    plan.add_argument("--fix", metavar="K=V,...", help="fix plan settings, e.g. dp=8,tp=8,pp=16 (all: evaluate that one plan)")
    plan.add_argument("--space", choices=["loom", "all"],
                      help="loom: only plans `loom train` runs today; all: every composition (default; loom with --write-config)")
    plan.add_argument("--json", action="store_true", help="print every ranked plan as one JSON document")
    plan.add_argument("--timeline", metavar="PNG", help="simulate the best plan's step and draw its timeline")
    plan.add_argument("--write-config", metavar="FILE", help="write the best plan as a config `loom train` runs")

    tok = sub.add_parser("tokenize", help="write a text source's token ids into a token file, "
                         "streamed and resumable (docs/data.md)")
    tok.add_argument("source", metavar="SRC", help="a text file or folder, a .jsonl or .parquet "
                     "file, or stdlib (as data.source)")
    tok.add_argument("--tokenizer", required=True, metavar="T",
                     help='"bytes", "bpe:N" (trained on SRC, cached) or a tokenizer.json path')
    tok.add_argument("--out", required=True, metavar="FILE",
                     help="the token file: .u16 or .bin (uint16 ids), .u32 (uint32)")
    tok.add_argument("--text-field", default="text", help="JSON Lines: the field of the text")
    tok.add_argument("--text-column", default="text", help="Parquet: the column of the text")
    tok.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    bench = sub.add_parser("bench", help="measure this machine").add_subparsers(dest="bench", required=True)
    calibrate = bench.add_parser("calibrate", help="measure matmul, memory and gloo rates as the planner's "
                                 "cpu-here device (docs/planner-calibrate.md)")
    calibrate.add_argument("--out", metavar="PATH",
                           help="TOML file to write (default: where `--gpu cpu-here` reads it)")
    calibrate.add_argument("--quick", action="store_true",
                           help="fewer sizes and repetitions: ~20 s, not ~1 min")

    report = sub.add_parser("report", help="plot a run's metrics into RUN_DIR/report.png (and its timelines, if recorded)")
    report.add_argument("run_dir")

    export = sub.add_parser("export", help="consolidate a run's latest checkpoint into one file")
    export.add_argument("run_dir")
    export.add_argument("--to", choices=["safetensors", "hf"], default="safetensors",
                        help="safetensors: one file; hf: a Hugging Face model folder")
    export.add_argument("--out", help="output file (default: RUN_DIR/model.safetensors), or "
                        "folder with --to hf (default: RUN_DIR/hf)")

    # defaults (None here) are GenerateRequest's, in inference/run_dir.py: the parser imports no torch
    gen = sub.add_parser("generate", help="decode text with a run's latest checkpoint (KV cache, tensor parallel)")
    gen.add_argument("run_dir")
    gen.add_argument("--prompt", help="text to continue (bytes are tokens; default a newline)")
    gen.add_argument("--max-new-tokens", type=int, help="default 64; stops earlier when the context (model.seq_len) is full")
    gen.add_argument("--temperature", type=float, help="default 0.8; 0: greedy")
    gen.add_argument("--top-k", type=int, help="sample among the K most likely tokens only")
    gen.add_argument("--seed", type=int, help="sampling seed, default 0 (the same tokens at any --tp)")
    gen.add_argument("--samples", type=int, help="sequences decoded together as one batch (default 1)")
    gen.add_argument("--tp", type=int, help="tensor-parallel processes on this machine (default 1)")
    gen.add_argument("--compress", choices=["none", "int8"],
                     help="int8: the tp all-reduces send int8 with per-chunk scales (default none)")
    gen.add_argument("--overlap", action="store_true", default=None,
                     help="hide the tp all-reduces behind two nano-batches (needs --samples >= 2)")
    return parser


def _unique_run_dir(cfg) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... if taken, created here: a new run never writes
    into an old one, nor two new runs started together into one (mkdir is atomic)."""
    base = Path(cfg.run.dir) / cfg.run.name
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def _make_run_dir(run_dir: Path, leaf: bool = True) -> None:
    """Create the run folder (or find it, on --resume; `leaf` False: only the folder above
    it, where a new run's folder is then made) and check that a file can be written there,
    before any process starts: a run folder that is a file or under one, read-only, immutable
    or on a filesystem without folders of ours (/proc) is refused by name."""
    def refuse(why: str):
        return ConfigError(f"run folder {str(run_dir)!r} cannot be used: {why}; choose a folder "
                           "this user can write (run.dir)")
    folder = run_dir if leaf else run_dir.parent
    try:
        above = next(p for p in (run_dir, *run_dir.parents) if p.exists())
        if not above.is_dir():
            raise refuse(f"{str(above)!r} is a file, not a folder")
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        where = f" at {str(err.filename)!r}" if err.filename and str(err.filename) != str(run_dir) else ""
        raise refuse(f"it cannot be created ({err.strerror or err}{where})") from None
    try:
        with tempfile.TemporaryFile(dir=folder):  # deleted on close: nothing is left there
            pass
    except OSError as err:
        what = "no file can be written in it" if leaf else "it cannot be created"
        raise refuse(f"{what} ({err.strerror or err})") from None


def _resolve_train(args, lock=None):
    """(config, run folder of a resume, its checkpoint). A resume takes `lock` (a
    runlock.RunFolderLock) on the folder, if given, before it picks the checkpoint."""
    from loomtrain.train import checkpoint
    from loomtrain.train.config import load_config

    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"parallel.nproc={args.nproc}")
    if getattr(args, "max_restarts", None) is not None:
        overrides.append(f"run.max_restarts={args.max_restarts}")
    if getattr(args, "plan", None) is not None:
        overrides.append(f'parallel.plan="{args.plan}"')
    if args.skip_damaged and not args.resume:
        raise ConfigError("--skip-damaged goes with --resume RUN_DIR: it picks which of RUN_DIR's "
                          "checkpoints to resume from")
    if args.resume:
        run_dir = Path(args.resume)
        if args.config:
            raise ConfigError("give either a CONFIG or --resume RUN_DIR (which uses RUN_DIR/config.toml), not both")
        if not (run_dir / "config.toml").is_file():
            raise CheckpointError(f"--resume {str(run_dir)!r}: no config.toml there; is it a loom run folder?")
        cfg = load_config(run_dir / "config.toml", overrides)
        if lock is not None:  # ranks of a killed launcher may still be saving: wait for them
            from loomtrain.train.orphan import grace_s
            lock.take(run_dir, grace_s(cfg.parallel.timeout_s) + 10.0)
        if not checkpoint.list_checkpoints(run_dir):
            raise CheckpointError(f"--resume {str(run_dir)!r}: no complete checkpoint in {run_dir / 'checkpoints'}")
        rank0 = int(os.environ.get("RANK", 0)) == 0
        # a damaged, unsafe or unfitting checkpoint stops here, before anything is written
        from loomtrain.train.restart import resume_checkpoint
        latest, skipped = resume_checkpoint(
            cfg, run_dir, args.skip_damaged, warn=rank0,
            advice=f"resume from it with `loom train --resume {run_dir} --skip-damaged`")
        for line in skipped if rank0 else ():
            print(f"warning: --skip-damaged: {line}", file=sys.stderr)
        return _follow_tokenizer(cfg), run_dir, latest
    cfg = _follow_tokenizer(load_config(args.config, overrides))
    if cfg.parallel.plan == "auto":  # planned before anything is written: config.toml holds the plan
        from loomtrain.planner.apply import choose_here, resolve_auto
        cfg = resolve_auto(cfg, choose_here)
        if int(os.environ.get("RANK", 0)) == 0:
            p, t = cfg.parallel, cfg.train
            print(f'parallel.plan="auto" chose dp={p.dp_size} tp={p.tp} pp={p.pp} cp={p.cp} '
                  f"zero_stage={p.zero_stage} micro_batch={t.micro_batch} x {cfg.accumulation_steps} "
                  f"precision={t.precision}" + (f" schedule={p.schedule}" if p.pp > 1 else ""),
                  file=sys.stderr)
    if cfg.train.init_from is not None:  # a missing or mismatched checkpoint stops here
        from loomtrain.train.init_from import resolve_init_from
        cfg = resolve_init_from(cfg)
    return cfg, None, None


def _follow_tokenizer(cfg):
    """`cfg` with model.vocab_size its tokenizer's (data/tokenizer.py followed_vocab), the
    whole config validated again with it (parallel.tp must divide it, for one)."""
    from loomtrain.data.tokenizer import followed_vocab
    from loomtrain.train.config import config_from_dict

    size = followed_vocab(cfg)
    if size == cfg.model.vocab_size:
        return cfg
    tree = cfg.model_dump(exclude_none=True)
    tree["model"]["vocab_size"] = size
    return config_from_dict(tree, type(cfg))


def _rejoin(args) -> int:
    """`loom train --rejoin RUN_DIR --worker W`: this one process takes worker W's place in the
    run's parameter server (asyncsgd/train.py rejoin_async); the rest is checked there."""
    from loomtrain.train.config import load_config

    if args.rejoin is None or args.worker is None:
        raise ConfigError("--rejoin RUN_DIR and --worker W go together: they restart worker W "
                          'of the async.mode="ps" run in RUN_DIR')
    if (args.config or args.resume or args.overrides or args.nproc is not None or args.dry_run
            or args.skip_damaged):
        raise ConfigError("--rejoin uses RUN_DIR/config.toml as it is: give no CONFIG, --set, "
                          "--nproc, --resume, --skip-damaged or --dry-run with it")
    run_dir = Path(args.rejoin)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"--rejoin {str(run_dir)!r}: no config.toml there; is it a loom run folder?")
    from loomtrain.asyncsgd.train import rejoin_async
    return rejoin_async(load_config(run_dir / "config.toml"), run_dir, args.worker)


def cmd_train(args, stop=None) -> int:
    """`loom train`. Not under torchrun, the run folder is locked (train/runlock.py) from
    before anything is written there until the command ends; `--rejoin` joins a running run
    on purpose and takes no lock, nor does `--dry-run`, which writes nothing. `stop`: the
    StopFlag `entry` installed (None in-process: the run installs its own)."""
    from loomtrain.train.runlock import RunFolderLock
    from loomtrain.train.stop import in_torchrun

    if args.rejoin is not None or args.worker is not None:
        return _rejoin(args)
    lock = RunFolderLock()
    try:
        return _train(args, None if in_torchrun() or args.dry_run else lock, stop)
    finally:
        lock.release()


def _train(args, lock, stop=None) -> int:
    from loomtrain.train.stop import stopped_before_start as stopped
    if stopped(stop, args.resume, bool(args.resume)):  # before torch is even imported
        return 0
    from loomtrain.train import messages
    from loomtrain.train.launch import launch_forwarding_signals, launch_tolerant
    from loomtrain.train.run import train_worker
    from loomtrain.train.stop import in_torchrun
    from loomtrain.train.trainer import write_config

    cfg, run_dir, resume = _resolve_train(args, lock)
    if args.dry_run:
        if cfg.data.source == "digits":
            raise ConfigError('--dry-run estimates the memory and communication of the language '
                              'models; data.source="digits" (the classifier) is not covered yet')
        from loomtrain.train.dryrun_text import dry_run
        print(dry_run(cfg))
        return 0
    from loomtrain.train.task import check_task_data
    check_task_data(cfg)  # fail before spawning
    from loomtrain.parallel import check_units
    check_units(cfg)
    from loomtrain.zeroth.train import check_trainable
    check_trainable(cfg)  # optim.trainable selects something of the model
    from loomtrain.lowcomm.config import restarts_replicas
    replicas = restarts_replicas(cfg)  # a lost replica is restarted alone and rejoins
    if replicas and in_torchrun():
        raise ConfigError("run.max_restarts with lowcomm.algorithm=\"local_sgd\", \"diloco\" or "
                          "\"streaming_diloco\" "
                          "restarts a lost replica alone, which needs loom train's own launcher "
                          "(it hosts the store the replicas meet through); under torchrun use "
                          "torchrun's --max-restarts and set run.max_restarts=0")
    if in_torchrun():
        if run_dir is None:
            run_dir = Path(cfg.run.dir) / cfg.run.name  # every node must name the same folder
            if _restarted_by_torchrun():  # its own folder, as it was left
                resume = _torchrun_restart(cfg, run_dir)
            elif (run_dir / "checkpoints").exists() or (run_dir / "metrics.jsonl").exists():
                raise ConfigError(
                    f"run folder {str(run_dir)!r} already holds a run (under torchrun the folder is "
                    f"exactly run.dir/run.name on every node); continue it with --resume "
                    f"{run_dir}, or set another run.name")
        if int(os.environ["WORLD_SIZE"]) != cfg.parallel.nproc:
            raise ConfigError(
                f"parallel.nproc={cfg.parallel.nproc} but torchrun started WORLD_SIZE="
                f"{os.environ['WORLD_SIZE']} processes; set --nproc {os.environ['WORLD_SIZE']}")
    elif stopped(stop, run_dir, resume is not None):  # before anything is written
        return 0
    elif run_dir is None:
        _make_run_dir(Path(cfg.run.dir) / cfg.run.name, leaf=False)  # before it is made
        run_dir = _unique_run_dir(cfg)
        lock.take(run_dir, 0.0)  # a folder just made: the lock file is the first thing in it
    _make_run_dir(run_dir)
    if int(os.environ.get("RANK", 0)) == 0:
        if resume is None:  # a resumed run rewrites it only once its checkpoint has loaded
            write_config(run_dir, cfg)
            from loomtrain.data.tokenizer import save_run_tokenizer
            save_run_tokenizer(run_dir, cfg.data)
        print(f"run folder: {run_dir}", file=sys.stderr)
    if stopped(stop, run_dir, resume is not None):  # the ranks would only start to stop
        return 0
    payload = (cfg.model_dump(), str(run_dir), str(resume) if resume else None)
    if in_torchrun() or (cfg.parallel.nproc == 1 and not cfg.run.max_restarts):
        return train_worker(*payload, stop=stop)  # in this process; restarts need a launcher
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from loomtrain.train.restart import Restarts
    received: list[int] = stop.received if stop is not None else []  # a signal since: pending
    # the resource tracker (started with the first rank, in this environment) warns of
    # "leaked semaphore objects" whenever a rank is stopped before its teardown: the rank
    # ended on a message of its own, or was stopped because another did
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), quiet)))
    with (tempfile.TemporaryDirectory(prefix="loom-errors-") as errors,
          Restarts(cfg, run_dir, received, Path(errors)) as restarts):
        # ranks end with this process and hold its lock; their error messages come back here
        # (a lost parameter-server worker's in the line that reports the loss)
        payload += (os.getpid(), lock.for_ranks(), errors)
        try:
            # how the run's processes are launched, and what a dead one means, by mode:
            if cfg.asgd.mode == "ps":  # a dead worker does not end a parameter-server run
                launch_tolerant(cfg.parallel.nproc, train_worker, payload, received,
                                cfg.parallel.timeout_s, run_dir, cfg.asgd.servers, Path(errors))
            elif replicas:  # a lost replica does not stop the others (lowcomm/replicas.py)
                from loomtrain.train.replica_launch import launch_replicas
                launch_replicas(cfg, train_worker, payload, received, run_dir, Path(errors))
            else:  # a dead rank ends the attempt; run.max_restarts restart every rank
                launch_forwarding_signals(cfg.parallel.nproc, train_worker, payload, received,
                                          Path(errors), restarts)
        except ChildFailedError as err:
            messages.print_traceback(Path(errors))  # a rank's bug: its traceback, once
            failed = {f.exitcode for f in err.failures.values()}  # as torch's launcher saw them
            codes = failed | messages.codes(Path(errors))
            if restarts.ended is not None:  # torch reports one rank, not always the first
                codes.add(restarts.ended[2])
            # a rank that ended on a message of its own (2, 3, 4) said why, once, and so did
            # the heartbeat of one that named a stalled or dead peer; a rank that crashed or
            # was killed did not, and the others' messages are its consequences
            explained = codes <= {2, 3, 4} or messages.named(Path(errors))
            said = messages.report(Path(errors)) if explained and len(received) < 2 else 0
            if said:  # the exit code the first cause calls for (4: a collective failed)
                return said
            if len(received) > 1 or cfg.asgd.mode == "ps":
                why = ("killed after a second stop signal" if len(received) > 1 else
                       "the parameter server (rank 0) failed")
                print(f"error: {why} (exit codes {sorted(failed)}); see the messages above",
                      file=sys.stderr)
            else:
                print(f"error: {_first_failure(err, restarts.ended)}", file=sys.stderr)
            return next((c for c in (2, 3) if c in codes), 1)  # 2: user error, 3: non-finite abort
    return 0


def _first_failure(err, ended: tuple[int, int, int] | None) -> str:
    """The rank that ended first, by rank, pid and how it ended: `ended` (train/restart.py
    `Restarts.ended`), or else the one the elastic launcher reports (one node: its local rank
    is its rank)."""
    from loomtrain.train.launch import exit_text

    if ended is None:
        rank, failure = err.get_first_failure()
        ended = (rank, failure.pid, failure.exitcode)
    rank, pid, code = ended
    said = "" if code < 0 else "; see its messages above"
    return f"rank {rank} (pid {pid}) {exit_text(code)}; the other ranks were stopped{said}"


def _restarted_by_torchrun() -> bool:
    """Whether torchrun's agent started this process again after a failure (`torchrun
    --max-restarts N`; it counts its restarts in the environment of the ranks it starts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _torchrun_restart(cfg, run_dir: Path) -> Path | None:
    """The checkpoint a rank restarted by torchrun continues from (train/restart.py), said in
    one line by rank 0; torchrun itself reported the failure."""
    from loomtrain.train.restart import restart_checkpoint, starting_from

    rank0 = int(os.environ["RANK"]) == 0
    resume = restart_checkpoint(cfg, run_dir, rank0)
    if rank0:
        print(f"loom: restarted by torchrun (restart {os.environ['TORCHELASTIC_RESTART_COUNT']} "
              f"of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}): {starting_from(resume)}",
              file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # measured: 1 of 5 such restarts failed to connect, 0 of 7 with the store not shared
            print("loom: warning: torchrun shares its rendezvous store with the ranks, where a "
                  "restarted rank may find the previous attempt's addresses and fail to connect "
                  "(pytorch/pytorch#135712); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                  file=sys.stderr, flush=True)
    return resume


def cmd_plan(args) -> int:
    from loomtrain.planner.command import cmd_plan as plan
    return plan(args)


def cmd_bench(args) -> int:
    """`loom bench calibrate`: measure, print the figures, save where `--gpu cpu-here` (or,
    with --out, `--gpu PATH`) reads them. The path is checked before the minutes of measuring."""
    from loomtrain.planner import calibrate as cal
    from loomtrain.planner.specs import calibration_path

    out = Path(args.out) if args.out else calibration_path()
    if out.is_dir() or out.suffix != ".toml":
        raise ConfigError(f"--out {args.out!r}: give a .toml file path (the default, "
                          f"{calibration_path()}, is where `loom plan --gpu cpu-here` reads it)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot write the calibration to {str(out)!r}: {err}") from None
    if not os.access(out if out.exists() else out.parent, os.W_OK):
        raise ConfigError(f"cannot write the calibration to {str(out)!r}: permission denied")
    found = cal.measure(cal.QUICK if args.quick else cal.FULL)
    spec = cal.spec_from(found, "quick" if args.quick else "full")
    path = cal.save(spec, out)
    use = "--gpu cpu-here" if args.out is None else f"--gpu {path}"
    print(f"{cal.summary(spec, found)}\nsaved {path} (loom plan {use})")
    return 0


def cmd_report(args) -> int:
    from loomtrain.report import pipeline_note, write_report
    print(write_report(Path(args.run_dir)))
    note = pipeline_note(Path(args.run_dir))
    if note is not None:
        print(note)
    return 0


def cmd_export(args) -> int:
    from loomtrain.train.export import export_hf, export_safetensors
    export = export_hf if args.to == "hf" else export_safetensors
    print(export(Path(args.run_dir), Path(args.out) if args.out else None))
    return 0


def cmd_generate(args) -> int:
    from loomtrain.inference.run_dir import GenerateRequest, run

    given = {k: v for k, v in vars(args).items() if v is not None and k not in ("command", "run_dir")}
    req = GenerateRequest(args.run_dir, **given)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    try:
        result = run(req)
    except ChildFailedError as err:
        codes = sorted({f.exitcode for f in err.failures.values()})
        print(f"error: a generate worker failed (exit codes {codes}); see the messages above", file=sys.stderr)
        return 2 if 2 in codes else 1
    print(("\n" + "-" * 40 + "\n").join(result["texts"]))
    stopped = f" (stopped: the context of seq_len={result['seq_len']} tokens is full)" \
        if result["new_tokens"] < req.max_new_tokens else ""
    print(f"{result['new_tokens']} new tokens per sample at tp={req.tp}, "
          f"{result['ms_per_token']:.1f} ms per token (prefill included){stopped}", file=sys.stderr)
    return 0


def cmd_tokenize(args) -> int:
    """`loom tokenize`: an interrupt leaves FILE.progress, and the same command continues."""
    from loomtrain.data.tokenize import tokenize
    from loomtrain.data.tokenizer import parse

    out = Path(args.out)
    try:
        parse(args.tokenizer)
    except ValueError as err:
        raise ConfigError(str(err).replace("data.tokenizer=", "--tokenizer ")) from None
    try:
        n_docs, n_tokens = tokenize(args.source, args.tokenizer, out, args.text_field,
                                    args.text_column, progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"loom tokenize: interrupted; {out}.progress records what is written: run the same "
              "command again to continue", file=sys.stderr)
        return 130
    except OSError as err:
        raise ConfigError(f"--out {args.out!r} cannot be written ({err.strerror or err})") from None
    named = "" if args.tokenizer == "bytes" else f' data.tokenizer="{out}.tokenizer.json"'
    print(f"{out}: {n_docs} documents, {n_tokens} tokens (document starts in {out}.docs); "
          f"train on it with data.source=\"{out}\"{named}")
    return 0


def main(argv: list[str] | None = None, stop=None) -> int:
    """`loom` with `argv`; `stop`: `loom train`'s StopFlag, if `entry` installed one."""
    args = _parser().parse_args(argv)
    commands = {"train": lambda a: cmd_train(a, stop), "plan": cmd_plan, "report": cmd_report,
                "export": cmd_export, "generate": cmd_generate, "tokenize": cmd_tokenize,
                "bench": cmd_bench}
    try:
        return commands[args.command](args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def entry() -> None:
    """The process entry point (`loom`, `python -m loomtrain`): exit with main()'s code. A
    failure's code leaves through os._exit once the message is flushed: at interpreter
    teardown after a failed run, a torch/gloo background thread has been seen to abort the
    process ("terminate called without an active exception", SIGABRT) now and then, which
    would replace exit code 2 (bad input) with -6; nothing is left to write at that point.

    `loom train` installs its stop flag first thing, before any import of weight: a SIGINT or
    SIGTERM from then on is a stop (train/stop.py), never a KeyboardInterrupt traceback or a
    death by signal; one that arrives in the ~30 ms before (Python's own start) is not."""
    stop = None
    if sys.argv[1:2] == ["train"]:
        from loomtrain.train.stop import StopFlag
        stop = StopFlag()
    code = main(stop=stop)
    if stop is not None:
        from loomtrain.train.stop import ignore_stops
        ignore_stops()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
