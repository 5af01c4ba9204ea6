"""The rows a rank trains on at a step, as tensors on its device: the pieces the backprop loop
(trainer.py), the zeroth-order loop (zeroth/train.py) and the parameter server's workers
(asyncsgd/train.py) share. Which rows: data/sampler.py's `rank_samples`, a pure function of
the step, so a resumed run reads what the uninterrupted one would have."""

from __future__ import annotations

from loomtrain.data import rank_samples
from loomtrain.models import IGNORE_INDEX
from loomtrain.train.config import Config


def batches_of_step(sampler, cfg: Config, mesh, step: int, device, ranks=None,
                    dp: int | None = None):
    """This rank's micro-batches: the rows of dp ranks `ranks` (None: its own; a component's
    `loaded_ranks`, e.g. the whole pool that data.balance deals out by work) of the global
    batch cut in `dp` shares (None: the mesh's dp size; a replica of a run that outlives
    lost ones keeps its share of all of them, lowcomm/replica_train.py)."""
    dp = mesh.size("dp") if dp is None else dp
    ranks = [mesh.local_rank("dp")] if ranks is None else ranks
    out = []
    for micro in range(cfg.accumulation_steps):
        samples = [g for r in ranks for g in rank_samples(step, cfg.train.global_batch, r, dp,
                                                          cfg.train.micro_batch, micro)]
        out.append(load_rows(sampler, samples, cfg, device))
    return out


def load_rows(sampler, samples, cfg: Config, device) -> tuple:
    """(inputs, targets) of the rows `samples`, and their documents with `data.packing`."""
    x, y = sampler.batch(samples)
    docs = (sampler.documents(samples).to(device),) if cfg.data.packing else ()
    return (x.to(device), y.to(device), *docs)


def target_tokens(batches) -> int:
    """The target tokens (not IGNORE_INDEX) in this rank's micro-batches."""
    return sum(int((batch[1] != IGNORE_INDEX).sum()) for batch in batches)
