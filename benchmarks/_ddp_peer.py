"""The torch peer of benchmarks/faults.py: plain DDP training of loomtrain's tiny GPT.

    python -m torch.distributed.run --nproc-per-node W --standalone benchmarks/_ddp_peer.py \
        CORPUS PID_DIR [--timeout-s 60] [--steps 1000000]

Nothing of loomtrain but the model (`build_model`, a plain nn.Module): gloo's process group
with `timeout_s` as its timeout (torch's one bound on a stalled peer), DistributedDataParallel,
AdamW, and random windows of the corpus bytes (vocabulary 256, as loomtrain's). The sizes are
faults.py's loomtrain config: d_model 32, 2 layers, 2 heads, seq 32, global batch 8 split over
the ranks, cores // ranks intra-op threads per rank, at least 1 (what `loom train` gives one).
No error handling of its own: what a fault prints is torch's. Every rank writes its pid to
PID_DIR/rank<R>.pid once its process group exists, so the benchmark can signal one; rank 0
prints `step N` after each step.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from loomtrain.models import build_model
from loomtrain.models.config import ModelConfig

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32)
GLOBAL_BATCH = 8


def batch(tokens: torch.Tensor, step: int, rank: int, per_rank: int):
    """(inputs, targets) of `per_rank` windows drawn for this step and rank."""
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(0, len(tokens) - MODEL.seq_len - 1, (per_rank,), generator=gen)
    windows = torch.stack([tokens[s:s + MODEL.seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("pid_dir", type=Path)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--steps", type=int, default=10**6)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    written = args.pid_dir / f"{rank}.tmp"
    written.write_text(str(os.getpid()))
    written.rename(args.pid_dir / f"rank{rank}.pid")  # whole when seen
    tokens = torch.frombuffer(bytearray(args.corpus.read_bytes()), dtype=torch.uint8).long()
    torch.manual_seed(1)
    model = DistributedDataParallel(build_model(MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        x, y = batch(tokens, step, rank, GLOBAL_BATCH // world)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
