"""Corpora, token files and the distributed sampler."""

from __future__ import annotations

import numpy as np
import pytest

from loomtrain.data import WindowSampler, eval_samples, load_corpus, rank_samples
from loomtrain.data.documents import stdlib_files
from loomtrain.errors import DataError


def test_stdlib_corpus_is_deterministic_with_a_file_level_split():
    a = load_corpus("stdlib", 0.02, 256)
    b = load_corpus("stdlib", 0.02, 256)
    assert np.array_equal(a.train[:100_000], b.train[:100_000]) and np.array_equal(a.val, b.val)
    _, files = stdlib_files()
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    assert "site-packages" not in "".join(str(f) for f in files)
    # about 2% of the bytes are held out, by whole files
    assert 0.002 < len(a.val) / (len(a.train) + len(a.val)) < 0.1
    assert a.train.dtype == np.uint8


def test_text_folder_and_file(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(40):
        (folder / f"f{i:02d}.txt").write_text(f"file {i} " * 50)
    corpus = load_corpus(str(folder), 0.1, 256)
    assert len(corpus.val) > 0 and len(corpus.train) > len(corpus.val)
    single = tmp_path / "one.txt"
    single.write_bytes(bytes(range(256)) * 40)
    c = load_corpus(str(single), 0.25, 256)
    assert len(c.val) == 2560 and np.array_equal(c.val[:256], np.arange(256))


def test_token_file_is_memory_mapped_and_validated(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(10_000, dtype=np.uint16).tofile(path)
    c = load_corpus(str(path), 0.1, 10_000)
    assert isinstance(c.train, np.memmap) and c.train.dtype == np.uint16
    assert c.val[-1] == 9999
    with pytest.raises(DataError, match="vocab_size"):
        load_corpus(str(path), 0.1, 5000)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(DataError, match="multiple of 2"):
        load_corpus(str(odd), 0.1, 256)


def test_missing_source_and_small_vocab(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"), 0.1, 256)
    (tmp_path / "t.txt").write_text("hello " * 100)
    with pytest.raises(DataError, match="vocab_size"):
        load_corpus(str(tmp_path / "t.txt"), 0.1, 100)


def test_rank_slices_are_disjoint_and_cover_the_global_batch():
    gb, mb = 16, 2
    for dp in (1, 2, 4):
        for step in (0, 3):
            got = [g for r in range(dp) for m in range(gb // (dp * mb))
                   for g in rank_samples(step, gb, r, dp, mb, m)]
            assert sorted(got) == list(range(step * gb, (step + 1) * gb))
            assert len(set(got)) == gb


def test_sampler_epochs_are_permutations_and_batches_shift_by_one():
    tokens = np.arange(1001, dtype=np.uint16)
    s = WindowSampler(tokens, seq_len=10, seed=3)
    assert s.windows == 100
    epoch0 = [s.window_of(g) for g in range(100)]
    epoch1 = [s.window_of(g) for g in range(100, 200)]
    assert sorted(epoch0) == list(range(100)) == sorted(epoch1) and epoch0 != epoch1
    x, y = s.batch(range(5))
    assert x.shape == (5, 10) and (y[:, :-1] == x[:, 1:]).all() and (y - x == 1).all()
    assert WindowSampler(tokens, 10, seed=3).window_of(7) == s.window_of(7)  # pure in seed


def test_eval_samples_dealt_round_robin():
    parts = [eval_samples(5, 4, r, 2) for r in range(2)]
    assert [len(p) for p in parts] == [3, 2]
    flat = sorted(g for p in parts for rng in p for g in rng)
    assert flat == list(range(20))


def test_too_short_data_is_a_user_error_before_training(tmp_path, capsys):
    from loomtrain.cli import main

    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    code = main(["train", "--set", f'data.source="{short}"',
                 "--set", "model.seq_len=64", "--nproc", "1", "--set", f'run.dir="{tmp_path}"'])
    err = capsys.readouterr().err
    assert code == 2 and "too few for one window" in err and "Traceback" not in err
    assert not (tmp_path / "default").exists()  # refused before a run folder was made
