"""Who holds up a collective, judged from the ranks' heartbeat records: pure, no processes.

A rank blocked in one op reads the records of the ranks it waits for (comm/heartbeat.py
publishes them, comm/activity.py fills them) and `judge`s, first finding first:

1. a peer that left with a message naming a cause: that message, unchanged, so that every
   rank ends on the same text (the launcher prints it once) with the same exit code;
2. a peer whose process is gone (seen only on this rank's host) and that left nothing (a
   peer that left on the failure of its own collective did not die): it died without a
   message (exit code 1, as any crash);
3. a peer whose heartbeat is older than `heartbeat_timeout_s`: it stopped answering (4);
4. a peer that issued a different collective as the same op of the axis (4).

Each names one rank (the lowest of those found) with its host, pid and the op it was in, from
that rank's own record only: every rank that finds the same culprit writes the same text.
A peer that is alive but has not reached the op (a slow save, a long computation) is not a
fault; `behind` describes such peers, for the message of the collective's own timeout.

A record is a dict (JSON in the store): rank, host, pid, pid_ns, beat (a counter), wall (time.time()
of the beat), last ([axis, op, seq] or None), entered ({axis: [seq, op]}), waiting ({axis, op,
seq, ranks} or None) and left ({text, code, cause} or None).
"""

from __future__ import annotations

from dataclasses import dataclass

from loomtrain.comm.activity import P2P, Waiting

EXIT_DIED, EXIT_COMM = 1, 4


@dataclass(frozen=True)
class Peer:
    """What this rank knows of one peer: its record (None: none published yet), the age of
    its last beat as this rank estimates it, how long this rank has seen that same beat, and
    whether its process is gone."""

    record: dict | None
    age_s: float
    watched_s: float
    gone: bool = False


@dataclass(frozen=True)
class Finding:
    text: str
    code: int  # the exit code the text calls for
    cause: bool = True  # False: only a note on the peers, for the op's own error message


def ranks_text(ranks: list[int]) -> str:
    """A group's ranks, short at any size: [0, 1, 2] or [0, 8, ..., 1016] (128 ranks)."""
    if len(ranks) <= 8:
        return str(list(ranks))
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def who(record: dict) -> str:
    return f"rank {record['rank']} (host {record['host']}, pid {record['pid']})"


def doing(record: dict) -> str:
    """Where a rank was at its last heartbeat, by its own record."""
    waiting = record.get("waiting")
    if waiting:
        return (f"at its last heartbeat it was waiting in {waiting['op']} #{waiting['seq']} on "
                f"mesh axis {waiting['axis']!r} (ranks {waiting['ranks']})")
    if record.get("last"):
        axis, op, seq = record["last"]
        return (f"at its last heartbeat it was outside any collective; the last it had entered "
                f"was {op} #{seq} on mesh axis {axis!r}")
    return "at its last heartbeat it had entered no collective yet"


def judge(me: int, waiting: Waiting, peers: dict[int, Peer], timeout_s: float,
          min_watch_s: float) -> Finding | None:
    """The cause of rank `me`'s wait in `waiting`, if one is found among `peers` (the ranks it
    waits for, `me` left out). `min_watch_s`: how long a beat must have been seen
    unchanged before it counts as stale or its rank as dead (0 once the op has failed: then
    one reading is all there is)."""
    ordered = sorted(peers.items())
    for _, peer in ordered:
        left = peer.record and peer.record.get("left")
        if left and left.get("cause", True):
            return Finding(left["text"], left["code"])
    # a peer that left on its own failed collective is gone too, but did not die: without
    # that, a rank judging late named the lowest of them instead of the one SIGKILLed
    dead = [r for r, p in ordered if p.gone and p.record and not p.record.get("left")
            and p.watched_s >= min_watch_s]
    if dead:
        record = peers[dead[0]].record
        return Finding(f"{who(record)} ended without a message (its process is gone: killed or "
                       f"crashed); {doing(record)}.{_also(dead)}", EXIT_DIED)
    stale = [r for r, p in ordered if p.age_s >= timeout_s and p.watched_s >= min_watch_s
             and not (p.record and p.record.get("left"))]
    if stale:
        record = peers[stale[0]].record
        name = who(record) if record else f"rank {stale[0]}"
        where = doing(record) if record else "it has published no heartbeat"
        return Finding(f"{name} stopped answering: its heartbeat is over {timeout_s:g} s old "
                       f"(parallel.heartbeat_timeout_s); {where}. It is stopped (SIGSTOP, a "
                       f"debugger), or its host froze or lost the network.{_also(stale)}",
                       EXIT_COMM)
    return _mismatch(me, waiting, peers)


def _also(ranks: list[int]) -> str:
    return f" So did ranks {ranks[1:]}." if len(ranks) > 1 else ""


def _mismatch(me: int, waiting: Waiting, peers: dict[int, Peer]) -> Finding | None:
    """A peer whose op of the same number on this axis is another collective."""
    if waiting.op in P2P:
        return None
    for rank, peer in sorted(peers.items()):
        seq, op = (peer.record or {}).get("entered", {}).get(waiting.axis, (0, ""))
        if seq == waiting.seq and op != waiting.op:
            (a, op_a), (b, op_b) = sorted([(me, waiting.op), (rank, op)])
            return Finding(
                f"ranks {a} and {b} issued different collectives as op #{seq} on mesh axis "
                f"{waiting.axis!r} (ranks {ranks_text(waiting.peers)}): rank {a} {op_a}, rank "
                f"{b} {op_b}. Every rank of a group must issue the same collectives in the same "
                f"order.", EXIT_COMM)
    return None


def behind(waiting: Waiting, peers: dict[int, Peer]) -> str:
    """The peers that have not entered the op this rank waits in, with the age of their
    heartbeat and where they were, by their records (a send or receive: where its other end
    is). Appended to the op's own timeout message."""
    notes = []
    for _, peer in sorted(peers.items()):
        record = peer.record
        if record is None or record.get("left"):
            continue
        seq = record.get("entered", {}).get(waiting.axis, (0, ""))[0]
        if waiting.op in P2P or seq < waiting.seq:  # a send's two ends count different ops
            reached = "" if waiting.op in P2P else " had not reached it"
            notes.append(f"{who(record)}, heartbeat {peer.age_s:.1f} s old,{reached}: "
                         f"{doing(record)}")
    return "; ".join(notes)
