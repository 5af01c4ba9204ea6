"""data.partition = "by_file": the training files cut into one contiguous group per worker
(data/partition.py), read through the sampler by data-parallel ranks and async workers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_tree
from harness import run_world
from test_config import _refused

from loomtrain.data import (
    PartitionedSampler,
    WindowSampler,
    file_groups,
    load_corpus,
    part_sampler,
    partition_windows,
    rank_samples,
)
from loomtrain.data.corpus import Corpus
from loomtrain.errors import DataError
from loomtrain.train import trainer
from loomtrain.train.batches import batches_of_step
from loomtrain.train.config import config_from_dict, load_config
from loomtrain.train.launch import init_distributed
from loomtrain.train.metrics import read_metrics
from loomtrain.train.run import train_loop

SEQ = 128


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus("stdlib", 0.02, 256)


def test_file_groups_cut_at_the_nearest_file_boundaries():
    starts = np.array([0, 10, 20, 30])
    assert file_groups(starts, 40, 2).tolist() == [0, 20, 40]
    assert file_groups(starts, 40, 4).tolist() == [0, 10, 20, 30, 40]
    assert file_groups(np.array([0, 12, 27, 30]), 40, 2).tolist() == [0, 27, 40]
    # one huge file: the cuts move so that every part still holds a file
    assert file_groups(np.array([0, 100, 101, 102]), 103, 3).tolist() == [0, 100, 101, 103]
    with pytest.raises(DataError, match='data.partition="by_file".*4 workers.*only 3'):
        file_groups(np.array([0, 10, 20]), 30, 4)


@pytest.mark.parametrize("parts", [2, 4])
def test_parts_are_disjoint_and_tile_the_files(stdlib, parts):
    bounds = file_groups(stdlib.train_doc_starts, len(stdlib.train), parts)
    doc_starts = set(stdlib.train_doc_starts.tolist())
    assert bounds[0] == 0 and bounds[-1] == len(stdlib.train)
    assert all(int(b) in doc_starts for b in bounds[:-1])  # whole files only
    # about equal tokens: the stdlib has no file near a quarter of it
    assert np.diff(bounds).min() > 0.8 * len(stdlib.train) / parts
    for part in range(parts):
        windows = partition_windows(stdlib, SEQ, part, parts)
        first, end = int(bounds[part]), int(bounds[part + 1])
        assert len(windows) > 0
        # the part's windows tile its files from its first token: stride seq_len, inputs
        # disjoint, every window (inputs and targets) inside the part, < seq_len + 1 left over
        assert windows[0] == first and np.all(np.diff(windows) == SEQ)
        assert windows[-1] + SEQ + 1 <= end < windows[-1] + 2 * SEQ + 1
    everything = np.concatenate([partition_windows(stdlib, SEQ, p, parts) for p in range(parts)])
    assert len(np.unique(everything)) == len(everything)


def test_partition_is_deterministic(stdlib):
    again = load_corpus("stdlib", 0.02, 256)
    for part in range(4):
        assert np.array_equal(partition_windows(stdlib, SEQ, part, 4),
                              partition_windows(again, SEQ, part, 4))
    a, b = part_sampler(stdlib, SEQ, 3, 1, 4), part_sampler(again, SEQ, 3, 1, 4)
    assert torch.equal(a.batch(range(40))[0], b.batch(range(40))[0])


def test_a_worker_reads_only_its_own_files(stdlib):
    bounds = file_groups(stdlib.train_doc_starts, len(stdlib.train), 4)
    for part in range(4):
        sampler = part_sampler(stdlib, SEQ, 0, part, 4)
        starts = [sampler.start_of(g) for g in range(2 * sampler.windows)]
        assert all(bounds[part] <= s and s + SEQ + 1 <= bounds[part + 1] for s in starts)
        # an epoch of the part is a permutation of its windows
        assert sorted(starts[:sampler.windows]) == partition_windows(stdlib, SEQ, part, 4).tolist()
        x, y = sampler.batch(range(3))
        s = sampler.start_of(0)
        assert torch.equal(x[0], torch.from_numpy(stdlib.train[s:s + SEQ].astype(np.int64)))
        assert torch.equal(y[0], torch.from_numpy(stdlib.train[s + 1:s + SEQ + 1].astype(np.int64)))


def test_iid_samples_are_unchanged(stdlib):
    """The IID sampler is the one from before the partition: window perm_e[g mod W] of epoch e,
    stride seq_len from token 0; and one part holding every file is the same sampler."""
    iid = WindowSampler(stdlib.train, SEQ, 7, stdlib.train_doc_starts)
    windows = (len(stdlib.train) - 1) // SEQ
    samples = [0, 5, windows - 1, windows, windows + 3]
    x, y = iid.batch(samples)
    for row, g in enumerate(samples):
        epoch, offset = divmod(g, windows)
        start = int(np.random.default_rng([7, epoch]).permutation(windows)[offset]) * SEQ
        block = stdlib.train[start:start + SEQ + 1].astype(np.int64)
        assert torch.equal(x[row], torch.from_numpy(block[:-1]))
        assert torch.equal(y[row], torch.from_numpy(block[1:]))
    whole = part_sampler(stdlib, SEQ, 7, 0, 1)
    assert whole.windows == windows
    assert all(torch.equal(a, b) for a, b in zip(whole.batch(samples), (x, y)))
    assert torch.equal(whole.documents(samples), iid.documents(samples))


def _mesh(rank: int, dp: int):
    return SimpleNamespace(size=lambda axis: dp, local_rank=lambda axis: rank)


def test_dp_ranks_read_their_own_part_through_the_trainer(stdlib):
    """batches_of_step with a PartitionedSampler: rank r's rows of step s are rows
    s*B/dp ... of part r, in order, so each rank walks through its own files epoch by epoch."""
    dp, global_batch, micro_batch = 2, 8, 2
    cfg = config_from_dict({"train": {"global_batch": global_batch, "micro_batch": micro_batch},
                            "data": {"partition": "by_file"}, "parallel": {"nproc": dp}})
    sampler = PartitionedSampler(stdlib, SEQ, 0, dp, global_batch // dp)
    for rank in range(dp):
        own = part_sampler(stdlib, SEQ, 0, rank, dp)
        for step in (0, 3):
            batches = batches_of_step(sampler, cfg, _mesh(rank, dp), step, "cpu")
            x = torch.cat([b[0] for b in batches])
            rows = range(step * 4, step * 4 + 4)
            assert torch.equal(x, own.batch(rows)[0])
            assert [sampler.locate(g) for g in rank_samples(step, 8, rank, dp, 4, 0)] == [
                (rank, r) for r in rows]
    # documents follow the rows, with the stream's document numbers
    samples = rank_samples(1, 8, 1, dp, 4, 0)
    part, local = sampler.locate(samples[0])
    assert torch.equal(sampler.documents(samples)[0], sampler.parts[part].documents([local])[0])


def test_too_few_tokens_for_a_part_is_named():
    corpus = Corpus(train=np.zeros(400, np.uint8), val=np.zeros(10, np.uint8), description="",
                    train_doc_starts=np.array([0, 10, 200]))
    with pytest.raises(DataError, match="worker 0 of 2 gets 200 tokens.*seq_len\\+1 = 201"):
        partition_windows(corpus, 200, 0, 2)


def test_by_file_needs_a_source_made_of_files(tmp_path, capsys):
    single = tmp_path / "one.txt"
    single.write_text("x = 1\n" * 2000)
    err = _refused(capsys, ["train", "--dry-run", "--set", f'data.source="{single}"',
                            "--set", 'data.partition="by_file"'])
    assert 'data.partition="by_file" gives each worker its own group' in err
    assert "is a single file" in err and 'data.partition="iid"' in err
    assert load_config(None, ['data.partition="by_file"']).data.partition == "by_file"
    assert load_config(None, [f'data.source="{tmp_path}"', 'data.partition="by_file"'])
    err = _refused(capsys, ["train", "--dry-run", "--set", 'data.partition="by_rank"'])
    assert "data.partition: Input should be 'iid' or 'by_file' (got 'by_rank')" in err


def _train(rank, world, tree, root):
    cfg = config_from_dict(tree)
    train_loop(cfg, Path(root), None, init_distributed(cfg), trainer.StopFlag())
    return [r["loss"] for r in read_metrics(Path(root))] if rank == 0 else None


def test_by_file_trains_with_data_parallelism(tmp_path, doc_corpus):
    tree = tiny_tree(tmp_path, doc_corpus, parallel={"nproc": 2}, train={"steps": 6},
                     data={"partition": "by_file"})
    losses = run_world(_train, 2, tree, str(tmp_path / "run"), timeout_s=120)[0]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]
