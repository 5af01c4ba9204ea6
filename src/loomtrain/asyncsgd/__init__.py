"""Asynchronous SGD: a parameter server (server.py; or several, each owning a slice of the
parameters: shard.py) and its workers (worker.py) over point-to-point messages (protocol.py),
with staleness policies (policies.py) and restarted workers rejoining (rejoin.py); train.py is
the `loom train` mode ([async] mode = "ps"), imported by train/run.py when used (it imports the
trainer, so it is not imported here)."""

from loomtrain.asyncsgd.policies import Policy, StalenessLog, build_policy
from loomtrain.asyncsgd.rejoin import rejoin_worker
from loomtrain.asyncsgd.server import Membership, ServerResult, serve
from loomtrain.asyncsgd.worker import WorkerResult, run_worker

__all__ = ["Membership", "Policy", "ServerResult", "StalenessLog", "WorkerResult", "build_policy",
           "rejoin_worker", "run_worker", "serve"]
