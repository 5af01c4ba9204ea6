"""The backprop loop of one replica of a local SGD or DiLoCo run that outlives a lost replica
(`run.max_restarts` > 0; the launcher: train/replica_launch.py): `run_replica`, the process's
run, and `ReplicaMode`, the backprop mode whose collective phases go through the replica
group's guard (lowcomm/replicas.py).

Each replica keeps its index: its rows of the global batch are its own, also while others
are away (their rows are not trained on then: the global batch shrinks, as under torchft).
The lowest member writes metrics.jsonl (with `replicas`, the members' count, and after a
sync `replica_fingerprints`) and publishes the checkpoints. Guide: docs/lowcomm.md, "Lost
replicas".
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from loomtrain import comm
from loomtrain.errors import CheckpointError
from loomtrain.lowcomm.quorum import (AGREE, BEGIN, RECORD, SAVE, SETTLE, STOP_SAVE, STOP_SETTLE,
                                      SYNC, done_of, phase_of, position)
from loomtrain.lowcomm.replicas import ReplicaGroup, Seat
from loomtrain.lowcomm.state import LowcommStateLayout, lowcomm_state
from loomtrain.train.backprop import BackpropMode
from loomtrain.train.batches import batches_of_step, target_tokens
from loomtrain.train.launch import pick_device
from loomtrain.train.loop import log_first_lines, resume_run, run_loop
from loomtrain.train.metrics import RunLog, open_log, truncate_metrics
from loomtrain.train.task import load_task_data
from loomtrain.train.stop import StopFlag

# a checkpoint that fails while a replica is lost fails on every member (DCP gathers each
# rank's outcome), as a CheckpointError or the process group's own RuntimeError
_SAVE_ERRORS = (comm.CollectiveError, CheckpointError, RuntimeError)


class ReplicaStateLayout(LowcommStateLayout):
    """The low-communication checkpoint (lowcomm/state.py) with every replica's inner
    optimizer state also while some are away: the lowest member writes its own in their
    place, which is what a replica that rejoins would take. So a checkpoint always resumes at
    parallel.nproc replicas."""

    def __init__(self, group: ReplicaGroup):
        self.group = group

    def state(self, model, optimizer, for_saving: bool = True) -> dict:
        state = lowcomm_state(model, optimizer)
        if for_saving and self.group.writer:
            own = state["optim"][f"replica{model.replica}"]
            state["optim"].update({f"replica{r}": own for r in self.group.away})
        return state


class ReplicaMode(BackpropMode):
    """Backprop whose control all-reduce, syncs, records and checkpoints survive a lost
    replica, and which lets restarted ones in at a step boundary after a sync."""

    def __init__(self, cfg, mesh, data, fresh: bool, group: ReplicaGroup):
        super().__init__(cfg, mesh, data, fresh)
        self.group = group
        model = self.built.model
        model.replica_index = group.replica
        model.sync_guard = lambda sync, settle=False: group.guard(
            (STOP_SETTLE if self.stopping else SETTLE) if settle else SYNC, sync)
        self.stopping = False  # a stop was agreed: its checkpoint comes after the control
        self.built.layout = ReplicaStateLayout(group)
        group.built, group.reformed = self.built, self._reformed
        self.news: str | None = None  # the latest re-form, for a writer whose log is not open

    def load(self, step: int):
        group = self.group
        batches = batches_of_step(self.data.train, self.cfg, self.mesh, step, self.mesh.device,
                                  [group.replica], dp=group.nproc)
        return batches, batches

    def begin(self, step: int, stop):
        group, model = self.group, self.built.model
        group.done = step
        work, batches = self.load(step)
        tokens = target_tokens(batches)
        while True:
            group.control = group.guard(BEGIN, lambda: self._control(tokens, stop),
                                        caught_up=lambda: group.control)
            global_tokens, stopping, joining, _ = group.control
            if joining and not stopping and model.joinable():
                group.admit(position(group.done, BEGIN))  # then this step's control again
                continue
            self.stopping = stopping
            return (work, global_tokens), stopping

    def _control(self, tokens: int, stop) -> tuple[float, bool, bool, bool]:
        """(global target tokens, whether a replica got SIGINT/SIGTERM, whether a replica
        asked to join, whether a replica is in a non-finite streak), agreed in one all-reduce:
        the last is what a stop's checkpoint follows (`in_streak`)."""
        # a replica that is stopping lets no one in; nor asks the store, whose launcher may
        # be the one that died (train/orphan.py)
        joining = not stop.signum and self.group.join_requested()
        control = torch.tensor([tokens, bool(stop.signum), joining, self.streak > 0],
                               dtype=torch.float64, device=self.mesh.device)
        comm.all_reduce(control, self.mesh, "world")
        return float(control[0]), bool(control[1]), bool(control[2]), bool(control[3])

    def in_streak(self, done: int) -> bool:
        """Whether a member is in a non-finite streak: at a stop, as the control all-reduce
        agreed; before any other checkpoint, agreed in a phase of its own (AGREE)."""
        group = self.group
        if self.stopping:
            return group.control[3]
        group.done = done
        group.streaking = group.guard(AGREE, self.agree_streak, caught_up=lambda: group.streaking)
        return group.streaking

    def run(self, step: int, work):
        self.group.done = step + 1  # the sync after the step is at its position
        return super().run(step, work)

    def record(self, done, result, evaluate, tokens_per_s, elapsed_s):
        group = self.group
        group.done = done

        def attempt() -> dict:
            step = result.detail  # a retry starts from this replica's own loss again
            fresh = replace(result, detail=replace(step, loss_sum=step.loss_sum.clone()))
            rec = super(ReplicaMode, self).record(done, fresh, evaluate, tokens_per_s,
                                                  elapsed_s)
            rec["replicas"] = len(group.members)
            if self.built.model.one_model():
                rec["replica_fingerprints"] = group.fingerprints()
            return rec
        return group.guard(RECORD, attempt)

    def save(self, done, extra=None):
        group = self.group
        group.done = done
        self.built.model.end_period()  # its sync is guarded by itself

        def attempt() -> None:  # loom.json names the replicas away, if any
            away = {"replicas_away": group.away} if group.away else {}
            super(ReplicaMode, self).save(done, {**(extra or {}), **away})
        group.guard(STOP_SAVE if self.stopping else SAVE, attempt, errors=_SAVE_ERRORS)
        group.saved_at = done  # a member caught up past the save: the source published it

    def _reformed(self, before: list[int], agreed: int, source: int, seconds: float) -> None:
        """The writer's role moves to the lowest member; it says what changed."""
        group, log = self.group, getattr(self, "log", None)
        members = group.members
        lost = [r for r in before if r not in members]
        joined = [r for r in members if r not in before]
        done = done_of(agreed)
        where = f"before step {done + 1}" if phase_of(agreed) == BEGIN else f"at step {done}"
        parts = ([f"replica {_names(lost)} lost {where}"] if lost else []) + (
            [f"replica {_names(joined)} rejoined {where} with the model of replica {source}"]
            if joined else [])
        self.news = (f"{'; '.join(parts) or 'group re-formed after a failed collective'}: "
                     f"{len(members)} of {group.nproc} replicas train on (re-formed in "
                     f"{seconds:.2f} s)")
        if log is not None:
            _hand_over_writing(log, self.run_dir, group.writer, done)
            log.message(self.news)


def _names(replicas: list[int]) -> str:
    return ", ".join(map(str, replicas))


def _hand_over_writing(log: RunLog, run_dir: Path, writer: bool, done: int) -> None:
    """Open or close this replica's metrics.jsonl when the writer's role comes or goes; a
    new writer first cuts a record a lost writer left torn."""
    if writer == log.enabled:
        return
    if writer:
        truncate_metrics(run_dir, done)
        log.file = open_log(run_dir / "metrics.jsonl")
    else:
        log.file.close()
        log.file = None
    log.enabled = writer


def run_replica(cfg, run_dir: Path, resume: Path | None, seat: Seat, stop: StopFlag) -> int:
    """One replica process (`stop`: its stop flag): joins epoch 0 (or, restarted, a group of
    its own until it is let in), trains, leaves its group."""
    device = pick_device(cfg.run, 0)
    if device.type == "cpu":  # the replicas share this host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // seat.nproc))
    group = ReplicaGroup(seat, cfg.parallel.timeout_s, device)
    group.start(seat.joining)
    with group.session():
        return _train(cfg, run_dir, resume, group, seat.joining, stop)


def _train(cfg, run_dir: Path, resume: Path | None, group: ReplicaGroup, joining: bool,
           stop) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.run.seed)
    data = load_task_data(cfg, group.nproc)
    mode = ReplicaMode(cfg, group.mesh, data, resume is None and not joining, group)
    mode.run_dir = run_dir
    if joining:
        start = group.join(stop)
        if start is None:  # nothing to do: the run ended, or was stopped, before it was let in
            return 0
    else:
        start = group.saved_at = resume_run(mode.built, run_dir, resume)
    if joining and group.writer:  # replica 0 back: it writes from here on
        truncate_metrics(run_dir, start)  # a record the lost writer left torn
    mode.log = log = RunLog(run_dir, cfg.train.steps, start, group.writer, cfg.run.progress,
                            mode.utilization())
    try:
        if not joining:
            log_first_lines(mode, data, start, resume)
        else:
            log.message(mode.news)
        return run_loop(mode, run_dir, start, stop, saved_at=group.saved_at)
    finally:
        log.close()
