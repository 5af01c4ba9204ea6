"""The one communication layer: every torch.distributed collective in loomtrain goes through here."""

from loomtrain.comm.collectives import (
    CollectiveError,
    Pending,
    all_reduce,
    barrier,
    broadcast,
    recv,
    send,
)
from loomtrain.comm.meter import CommMeter, wire_bytes

__all__ = [
    "CollectiveError", "CommMeter", "Pending", "all_reduce", "barrier", "broadcast", "recv",
    "send", "wire_bytes",
]
