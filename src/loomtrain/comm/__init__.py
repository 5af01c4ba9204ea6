"""The one communication layer: every torch.distributed collective in loomtrain goes through here."""

from loomtrain.comm.collectives import (
    IMPLS,
    CollectiveError,
    Pending,
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_uneven,
    barrier,
    broadcast,
    choose_impl,
    recv,
    reduce_scatter,
    send,
    shapes_only,
)
from loomtrain.comm.link import SlowLink
from loomtrain.comm.meter import CommMeter, wire_bytes
from loomtrain.comm.pair import (
    MeshChannel,
    PairChannel,
    PairError,
    PairHost,
    PairRefused,
    join_pair,
    probe,
)
from loomtrain.comm.quantized import PendingQuantized, quantized_all_reduce
from loomtrain.comm.sparse import PendingSparse, SparseResult, sparse_all_reduce

__all__ = [
    "CollectiveError", "CommMeter", "Pending", "all_reduce", "barrier", "broadcast", "recv",
    "send", "shapes_only", "wire_bytes",
    "IMPLS", "all_gather", "all_to_all", "all_to_all_uneven", "choose_impl", "reduce_scatter",
    "PendingQuantized", "quantized_all_reduce", "SlowLink",
    "PendingSparse", "SparseResult", "sparse_all_reduce",
    "MeshChannel", "PairChannel", "PairError", "PairHost", "PairRefused", "join_pair", "probe",
]
