"""The wire protocol of the parameter server (server.py) and its workers (worker.py): which ranks
serve and which work, the PULL / PUSH / PARAMS messages (an int64 header and an fp32 body, one
tag per kind) and what each costs, with one server or several each owning a slice of the
parameters. Specification: docs/async.md, "The protocol" and "Sharded servers".
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from loomtrain import comm

HEADER_WORDS = 4
VERSION, STEP, STOP = 0, 1, 2  # header word indices
LOSS = 2  # PUSH: the word PARAMS uses for STOP holds the loss (fp64 bits)
COUNT = 3  # PUSH: how many gradients the body averages
# distinct from 0 (comm.send's default) and unlikely to meet a ring op's crc-derived tag
TAG_PULL, TAG_PUSH, TAG_PARAMS = 0x41530001, 0x41530002, 0x41530003
TAG_SLICE = 0x41530004  # sharded servers, at the end: server s's final slice to server 0


@dataclass
class Message:
    """A message's buffer (what is sent) and its two views into it."""

    buffer: torch.Tensor  # uint8: header bytes, then body bytes
    header: torch.Tensor  # int64 [HEADER_WORDS]
    body: torch.Tensor  # fp32 [numel] (empty for PULL)


def message(numel: int) -> Message:
    """A message with a zeroed header and an uninitialized body of `numel` fp32 values."""
    head = 8 * HEADER_WORDS
    buffer = torch.empty(head + 4 * numel, dtype=torch.uint8)
    buffer[:head].zero_()  # words a kind does not use go out as 0
    return Message(buffer, buffer[:head].view(torch.int64), buffer[head:].view(torch.float32))


def write_header(msg: Message, version: int, step: int = 0, stop: bool = False) -> None:
    msg.header[VERSION], msg.header[STEP], msg.header[STOP] = version, step, int(stop)


def write_loss(msg: Message, loss: float | None) -> None:
    """A PUSH's loss into header word LOSS (None: not reported, sent as NaN)."""
    msg.header[LOSS:LOSS + 1].view(torch.float64)[0] = float("nan") if loss is None else loss


def read_loss(msg: Message) -> float:
    """The loss a PUSH carries (NaN: the worker reported none)."""
    return float(msg.header[LOSS:LOSS + 1].view(torch.float64)[0])


def write_count(msg: Message, gradients: int) -> None:
    """A PUSH's k: its body is the mean of this many gradients."""
    msg.header[COUNT] = gradients


def read_count(msg: Message) -> int:
    return int(msg.header[COUNT])


class Inbox:
    """Completion events of p2p ops, in the order they complete, so the server blocks on
    `next()` instead of polling its receives.

    Why threads: gloo's send/recv works have no future (`Work::getFuture not implemented`) and
    `is_completed()` stays False forever when the peer has died, while `wait()` raises at once
    ("Connection closed by peer", measured with torch 2.13). So one lane thread per key (per
    worker) calls `Pending.wait()` on that key's ops in order and reports either completion or
    the `CollectiveError`: a dead peer is noticed at once, and the server sleeps until
    something happens or its next deadline. A hung (alive, silent) peer's op stays in its lane
    until the process-group timeout; the server does not wait for it (its own deadline
    decides), and the lane is a daemon thread, so it never blocks the process from ending.

    Every torch.distributed call stays on the caller's thread: lanes only wait. Other threads
    that wait for something (a rejoin request: comm.PairHost's watcher) `report` into the same
    queue, so the server still sleeps on one `next()`.
    """

    def __init__(self):
        self._events: queue.Queue = queue.Queue()
        self._lanes: dict[int, queue.Queue] = {}

    def watch(self, key, what: str, pending: comm.Pending) -> None:
        """Report `(key, what, None)` when `pending` (anything with `wait()`) completes,
        `(key, what, error)` if it fails; a key's ops are reported in the order they were given,
        by one lane per key (any hashable)."""
        if key not in self._lanes:
            self._lanes[key] = queue.Queue()
            threading.Thread(target=self._lane, args=(key, self._lanes[key]), daemon=True,
                             name=f"asyncsgd-inbox-{key}").start()
        self._lanes[key].put((what, pending))

    def report(self, key, what: str, detail=None) -> None:
        """Queue the event `(key, what, detail)` (from any thread)."""
        self._events.put((key, what, detail))

    def next(self, timeout_s: float | None):
        """The next event, or None when none came within `timeout_s` (None: wait forever)."""
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        """End every lane once its ops are done (a lane stuck on a hung peer ends at the
        process-group timeout)."""
        for lane in self._lanes.values():
            lane.put(None)

    def _lane(self, key: int, lane: queue.Queue) -> None:
        while (item := lane.get()) is not None:
            what, pending = item
            try:
                pending.wait()
            except comm.CollectiveError as err:
                self._events.put((key, what, err))
                continue
            self._events.put((key, what, None))
