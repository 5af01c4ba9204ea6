"""Asynchronous SGD: a parameter server (server.py) and its workers (worker.py) over
point-to-point messages (protocol.py), with staleness policies (policies.py); train.py is the
`loom train` mode ([async] mode = "ps"), imported by the trainer when used (it imports the
trainer, so it is not imported here)."""

from loomtrain.asyncsgd.policies import Policy, StalenessLog, build_policy
from loomtrain.asyncsgd.server import ServerResult, serve
from loomtrain.asyncsgd.worker import WorkerResult, run_worker

__all__ = ["Policy", "ServerResult", "StalenessLog", "WorkerResult", "build_policy", "run_worker",
           "serve"]
