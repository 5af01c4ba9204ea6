"""The components a run is assembled from, in the order they apply (docs/architecture.md):
the one list a new technique joins. The Config, its validation and the composition table
(docs/composition.md) are built from it."""

from __future__ import annotations

from loomtrain.asyncsgd.config import AsyncSGD, Straggler
from loomtrain.comm.compress.config import Compression
from loomtrain.comm.config import SimulatedLink
from loomtrain.component import Component, Refusal, Switch
from loomtrain.data.config import ByFile, Digits
from loomtrain.lowcomm.config import Lowcomm
from loomtrain.parallel.compile import Compile
from loomtrain.parallel.config import DataParallelComponent
from loomtrain.parallel.expert.config import ExpertParallel, Experts
from loomtrain.parallel.offload import ActivationOffload
from loomtrain.parallel.pipeline.config import AsyncPipeline, Pipeline
from loomtrain.parallel.recompute import Recompute
from loomtrain.parallel.sequence.config import Balance, Context, Packing
from loomtrain.parallel.tensor_config import TensorParallel
from loomtrain.parallel.zero.config import BF16, Zero
from loomtrain.planner.config import Plan
from loomtrain.sparsity.config import Sparsity
from loomtrain.zeroth.config import Zeroth


class InitFrom(Component):
    """train.init_from: a fresh run from a checkpoint's weights (train/init_from.py)."""

    name = "init_from"
    switches = (Switch("train.init_from", None, show_value=False),)
    summary = "a fresh run from another run's checkpointed weights"
    refuses = {"asyncsgd": Refusal("the parameter server starts from its own initialization; "
                                   "fine-tune with the synchronous trainer (async.mode=\"none\"), "
                                   "or resume the server's own run with --resume")}


class Timeline(Component):
    """run.timeline_step: one step's compute and communication recorded (timeline.py)."""

    name = "timeline"
    switches = (Switch("run.timeline_step", 0),)
    summary = "one step's compute and communication timeline"


# The order of their keys in a shared section and of their checks: the mesh first, then the
# apply order (tensor and sequence parallel, ZeRO, the pipeline split, context parallel,
# recomputation, compilation, the replica methods), the training modes, the data and the
# run's own features.
COMPONENTS: tuple[type[Component], ...] = (
    DataParallelComponent, TensorParallel, ExpertParallel, Zero, BF16, SimulatedLink, AsyncSGD, Straggler,
    Pipeline, AsyncPipeline, Context, Packing, Balance, Recompute, Compile, ActivationOffload,
    Lowcomm, Compression, Sparsity, Experts,
    Digits, ByFile, InitFrom, Zeroth, Plan, Timeline,
)
