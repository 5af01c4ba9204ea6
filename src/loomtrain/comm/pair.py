"""Point-to-point channels to one peer, and a rendezvous that lets a process started later (a
restarted parameter-server worker) open one to a process already running.

`MeshChannel` talks to a member of a mesh axis; `PairChannel` is a two-member gloo group built
through a TCPStore rendezvous (`PairHost`, `join_pair`). Protocol, failures and costs:
docs/comm.md, "Point-to-point channels and rejoining".
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loomtrain.comm.collectives import CollectiveError, recv, send
from loomtrain.comm.meter import CommMeter

log = logging.getLogger(__name__)

_REQUESTS = "pair/requests"  # the queue of "key generation" requests
_STOP = "stop"  # pushed by the host itself to end its watcher


class PairError(RuntimeError):
    """No pair host answers at the address, or it did not answer in time."""


class PairRefused(PairError):
    """The host refused the request; the message is the host's reason."""


@dataclass(frozen=True)
class MeshChannel:
    """Member `peer` of `axis` on `mesh`, through comm.send/comm.recv."""

    mesh: object
    axis: str
    peer: int

    @property
    def name(self) -> str:
        return f"rank {self.mesh.group_ranks(self.axis)[self.peer]}"

    def send(self, tensor: torch.Tensor, *, tag: int, async_op: bool = False):
        return send(tensor, self.mesh, self.axis, self.peer, async_op=async_op, tag=tag)

    def recv(self, tensor: torch.Tensor, *, tag: int, async_op: bool = False):
        return recv(tensor, self.mesh, self.axis, self.peer, async_op=async_op, tag=tag)


class PairChannel:
    """A two-member gloo group between this process (member `me`) and one peer (1 - me).
    gloo matches a send to the receive of the same tag, as on the world group."""

    def __init__(self, group, me: int, name: str, meter: CommMeter, axis: str, timeout_s: float):
        self.group, self.me, self.name = group, me, name
        self.meter, self.axis, self.timeout_s = meter, axis, timeout_s

    def send(self, tensor: torch.Tensor, *, tag: int, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        self.meter.record(self.axis, "send", nbytes, nbytes)
        self.meter.last_op = f"send on {self.name} ({nbytes} bytes)"
        return self._start("send", lambda: self.group.send([tensor], 1 - self.me, tag), async_op)

    def recv(self, tensor: torch.Tensor, *, tag: int, async_op: bool = False):
        self.meter.last_op = f"recv on {self.name} ({tensor.numel() * tensor.element_size()} bytes)"
        return self._start("recv", lambda: self.group.recv([tensor], 1 - self.me, tag), async_op)

    def _start(self, op: str, call, async_op: bool):
        try:
            work = call()
        except RuntimeError as err:
            raise self.failure(op, err) from None
        pending = PairPending(work, self, op)
        if async_op:
            return pending
        pending.wait()
        return None

    def failure(self, op: str, err: Exception) -> CollectiveError:
        return CollectiveError(f"{op} on the {self.name} failed or did not complete within "
                               f"{self.timeout_s} s: the peer died or hung. Cause: {err}")


class PairPending:
    """An op in flight on a PairChannel; `wait()` blocks and raises CollectiveError on failure
    (what `comm.Pending.wait` does for the mesh's ops)."""

    def __init__(self, work, channel: PairChannel, op: str):
        self._work, self._channel, self._op = work, channel, op

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            self._work.wait()
        except RuntimeError as err:
            raise self._channel.failure(self._op, err) from None
        self._work = None


class PairHost:
    """The long-running side of the rendezvous (docs/comm.md): a TCPStore master on a free
    port of this machine, published as `address` (`host`: the name in it, default this
    machine's). Construct, `watch` and answer on one thread; `close` ends the watcher (a request
    then gets no answer: the newcomer's PairError) and drops the store."""

    def __init__(self, timeout_s: float, host: str | None = None):
        self.host = host or _this_host()
        self.timeout_s = timeout_s
        self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.port = self._store.port
        self._watcher: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def watch(self, report: Callable[[int, int], None]) -> None:
        """Call `report(key, generation)` (on the watcher thread) for every request."""
        store = self._store.clone()  # one store connection per thread (TCPStore.clone's rule)
        store.set_timeout(datetime.timedelta(days=1))  # a timeout only re-arms the wait
        self._watcher = threading.Thread(target=_watch, args=(store, report), daemon=True,
                                         name="pair-host")
        self._watcher.start()

    def accept(self, key: int, generation: int, answer: dict, meter: CommMeter,
               axis: str) -> PairChannel:
        """Send `answer` to the newcomer and build the pair group with it (member 0); raises
        PairError if the newcomer does not build its side within timeout_s."""
        self._store.set(_answer_key(key, generation), json.dumps({"accepted": True, **answer}))
        group = _pair_group(self._store, key, generation, 0, self.timeout_s)
        return PairChannel(group, 0, f"pair channel to {key}/{generation}", meter, axis,
                           self.timeout_s)

    def refuse(self, key: int, generation: int, reason: str) -> None:
        self._store.set(_answer_key(key, generation), json.dumps({"refused": reason}))

    def close(self) -> None:
        if self._watcher is not None:
            self._store.queue_push(_REQUESTS, _STOP)
            self._watcher.join(self.timeout_s)
            self._watcher = None
        self._store = None  # the master stops listening once no reference is left


def _this_host() -> str:
    """This machine's name as others reach it, or loopback if the name does not resolve (the
    store's own client connects to it; rejoins then work from this machine only)."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return "127.0.0.1"
    return name


def _watch(store, report: Callable[[int, int], None]) -> None:
    while True:
        try:
            request = store.queue_pop(_REQUESTS).decode()
        except dist.DistStoreError:  # the wait's timeout: wait again
            continue
        except RuntimeError as err:  # the store is gone
            log.warning("pair host: the rendezvous store failed; no more rejoins: %s", err)
            return
        if request == _STOP:
            return
        try:
            key, generation = (int(part) for part in request.split())
        except ValueError:
            log.warning("pair host: ignored a malformed request %r", request)
            continue
        report(key, generation)


def probe(address: str, timeout_s: float) -> tuple[str, int]:
    """(host, port) of `address` ("host:port") if something listens there; else PairError.
    A plain socket: the store's own client retries for its whole timeout, noisily."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as err:
        raise PairError(f"nothing answers at {address}: {err}") from None
    return host, int(port)


def join_pair(address: str, key: int, timeout_s: float, meter: CommMeter,
              axis: str) -> tuple[PairChannel, dict]:
    """Ask the PairHost at `address` for a channel under `key`: (the channel, the host's
    answer). Raises PairRefused with the host's reason, PairError if nobody answers."""
    host, port = probe(address, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        generation = store.add(f"pair/generation/{key}", 1)
        store.queue_push(_REQUESTS, f"{key} {generation}")
        store.wait([_answer_key(key, generation)], timeout)
        answer = json.loads(store.get(_answer_key(key, generation)))
    except RuntimeError as err:  # DistError: gone, or no answer within the timeout
        raise PairError(f"the pair host at {address} did not answer within {timeout_s} s: "
                        f"{err}") from None
    if "refused" in answer:
        raise PairRefused(answer["refused"])
    group = _pair_group(store, key, generation, 1, timeout_s)
    return PairChannel(group, 1, f"pair channel {key}/{generation} to {address}", meter, axis,
                       timeout_s), answer


def _answer_key(key: int, generation: int) -> str:
    return f"pair/answer/{key}/{generation}"


def _pair_group(store, key: int, generation: int, me: int, timeout_s: float):
    try:
        return dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{key}/{generation}/", store), me, 2,
                                     datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise PairError(f"the pair group {key}/{generation} was not built within {timeout_s} s "
                        f"(the other side died or never came): {err}") from None
