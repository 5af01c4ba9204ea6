"""Tokenizers, text sources and token files (issue 27, points 3, 4 and 7): bpe:N trained,
deterministic and cached, a tokenizer.json by path, uint32 token files, model.vocab_size
following the tokenizer, JSON Lines and Parquet sources, `loom tokenize` streamed and resumed,
document boundaries kept, and a bpe run trained and decoded end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from conftest import refused, tiny_tree
from loomtrain.cli import main
from loomtrain.data import load_corpus
from loomtrain.data import tokenize as tokenize_module
from loomtrain.data import tokenizer as tk
from loomtrain.data.tokenfile import docs_path
from loomtrain.errors import DataError
from loomtrain.train.config import config_from_dict
from loomtrain.train.task import check_task_data

BPE = "bpe:320"  # the 60 KB corpus has pairs enough for 64 merges


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A bpe cache of this test's own, so that no test reads another's tokenizer."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "loomtrain" / "tokenizers"


@pytest.fixture
def records(corpus) -> list[str]:
    """The corpus cut at blank lines: ~200 documents of Python source."""
    return [part for part in corpus.read_text().split("\n\n") if part.strip()]


def _jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _config(tmp_path: Path, source: Path, **sections) -> str:
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(tiny_tree(tmp_path, source, **sections)))
    return str(path)


def test_bpe_is_deterministic_and_cached(corpus, cache, monkeypatch):
    first = tk.load_tokenizer(BPE, str(corpus))
    assert first.vocab_size == 320 and first.path.parent.parent == cache
    again = tk.train_bpe(str(corpus), 320, "text", "text")
    assert again.to_str() == first.tokenizer.to_str()  # the same merges, the same ids
    text = corpus.read_bytes()[:5000]
    assert np.array_equal(first.encode(text), tk.HFTokenizer(again, first.path).encode(text))
    assert first.decode(first.encode(text)) == text.decode()
    stamp = first.path.stat().st_mtime_ns
    monkeypatch.setattr(tk, "train_bpe", lambda *a: pytest.fail("the cached bpe was retrained"))
    second = tk.load_tokenizer(BPE, str(corpus))
    assert second.path == first.path and first.path.stat().st_mtime_ns == stamp
    # another vocabulary, or an edited source, is another tokenizer
    assert tk.bpe_path(str(corpus), 330, "text", "text") != first.path


def test_a_tokenizer_json_by_path(tmp_path, corpus, capsys):
    saved = tmp_path / "tok.json"
    saved.write_text(tk.load_tokenizer(BPE, str(corpus)).path.read_text())
    by_path = tk.load_tokenizer(str(saved), str(corpus))
    c = load_corpus(str(corpus), 0.1, 320, by_path)
    assert c.train.dtype == np.uint16 and int(c.train.max()) < 320
    assert by_path.decode(np.concatenate([c.train, c.val])) == corpus.read_text()
    err = refused(capsys, ["train", _config(tmp_path, corpus, data={"tokenizer": str(tmp_path / "no.json")}),
                           "--dry-run"])
    assert "does not exist" in err and "no.json" in err


def test_uint32_token_file_round_trips_with_its_documents(tmp_path):
    ids = np.array([0, 65_535, 65_536, 70_000, 5, 123_456, 9, 1] * 500, dtype=np.uint32)
    path = tmp_path / "big.u32"
    ids.tofile(path)
    np.array([0, 1000, 2500], dtype="<u8").tofile(docs_path(path))
    c = load_corpus(str(path), 0.25, 123_457)
    assert c.train.dtype == np.uint32 and np.array_equal(np.concatenate([c.train, c.val]), ids)
    assert list(c.train_doc_starts) == [0, 1000, 2500] and list(c.val_doc_starts) == [0]
    with pytest.raises(DataError, match="holds token id 123456"):
        load_corpus(str(path), 0.25, 70_001)
    np.array([0, 2500, 1000], dtype="<u8").tofile(docs_path(path))
    with pytest.raises(DataError, match="document starts"):
        load_corpus(str(path), 0.25, 123_457)


def test_vocab_size_follows_the_tokenizer_or_is_refused(tmp_path, corpus, capsys):
    err = refused(capsys, ["train", _config(tmp_path, corpus, data={"tokenizer": BPE},
                                            model={"vocab_size": 500}), "--dry-run"])
    assert "model.vocab_size=500" in err and "320 tokens" in err
    err = refused(capsys, ["train", _config(tmp_path, corpus), "--dry-run", "--set",
                           "model.vocab_size=300"])
    assert 'data.tokenizer="bytes"' in err and "model.vocab_size=300" in err
    assert main(["train", _config(tmp_path, corpus, data={"tokenizer": BPE}), "--dry-run"]) == 0
    assert "vocab 320" in capsys.readouterr().out
    # a preset's vocabulary (llama-debug: 256) is its own tokenizer's: it yields to this one
    tree = tiny_tree(tmp_path, corpus, data={"tokenizer": BPE})
    tree["model"] = {"preset": "llama-debug", "seq_len": 32}
    assert tk.followed_vocab(config_from_dict(tree)) == 320


def test_without_the_tokenizers_package_a_bpe_is_refused(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import raises ImportError
    err = refused(capsys, ["train", _config(tmp_path, corpus, data={"tokenizer": BPE}), "--dry-run"])
    assert "pip install" in err and "tokenizers" in err


def test_jsonl_and_parquet_hold_the_same_documents(tmp_path, records, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    jsonl = _jsonl(tmp_path / "d.jsonl", records)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": records}), parquet)
    a = load_corpus(str(jsonl), 0.1, 256)
    b = load_corpus(str(parquet), 0.1, 256, fields=("text", "body"))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert len(a.train_doc_starts) + len(a.val_doc_starts) == len(records)
    first = records[0].encode() + b"\n"  # a record is its text and a newline
    assert bytes(a.train[:len(first)]) == first or bytes(a.val[:len(first)]) == first
    with pytest.raises(DataError, match="no text in field 'body'"):
        load_corpus(str(jsonl), 0.1, 256, fields=("body", "text"))
    with pytest.raises(DataError, match="no column 'text'"):
        load_corpus(str(parquet), 0.1, 256)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    out = str(tmp_path / "x.u16")
    assert "cannot be read as Parquet" in refused(capsys, ["tokenize", str(tmp_path / "bad.parquet"),
                                                           "--tokenizer", "bytes", "--out", out])
    # a record found bad part way: the bar is closed first (its line ends), here not drawn
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    assert "line 2 is not JSON" in refused(capsys, ["tokenize", str(tmp_path / "bad.jsonl"),
                                                     "--tokenizer", "bytes", "--out", out,
                                                     "--no-progress"])


def test_tokenize_streams_resumes_and_keeps_documents(tmp_path, records, capsys, monkeypatch):
    source = str(_jsonl(tmp_path / "d.jsonl", records))
    whole = tmp_path / "whole.u32"
    assert main(["tokenize", source, "--tokenizer", BPE, "--out", str(whole)]) == 0
    assert "tokenize whole.u32" in capsys.readouterr().err  # the progress bar
    # interrupted after 50 documents, in chunks of 7, with a half-written chunk after the last
    # commit; the same command continues and writes the same bytes
    monkeypatch.setattr(tokenize_module, "CHUNK_DOCUMENTS", 7)
    part = tmp_path / "part.u32"
    assert tokenize_module.tokenize(source, BPE, part, progress=False, stop_after=50)[0] == 50
    with open(part, "ab") as f:
        f.write(b"\x01\x02\x03")
    assert tokenize_module.progress_path(part).is_file()
    assert main(["tokenize", source, "--tokenizer", BPE, "--out", str(part), "--no-progress"]) == 0
    assert part.read_bytes() == whole.read_bytes()
    assert docs_path(part).read_bytes() == docs_path(whole).read_bytes()
    assert not tokenize_module.progress_path(part).exists()
    # the documents' starts are where each record's own encoding begins
    tokenizer = tk.load_tokenizer(str(Path(f"{whole}.tokenizer.json")), source)
    lengths = [len(tokenizer.encode(r.encode() + b"\n")) for r in records]
    starts = np.fromfile(docs_path(whole), dtype="<u8")
    assert list(starts) == [0, *np.cumsum(lengths)[:-1]]
    # so data.packing can train on the token file; without FILE.docs it cannot
    packed = {"packing": True, "tokenizer": f"{whole}.tokenizer.json"}
    cfg = config_from_dict(tiny_tree(tmp_path, whole, data=packed, model={"vocab_size": 320}))
    assert f"{len(records)} documents" in check_task_data(cfg)
    docs_path(whole).unlink()
    capsys.readouterr()
    assert "FILE.docs" in refused(capsys, ["train", _config(tmp_path, whole, data=packed), "--dry-run"])


def test_train_with_bpe_then_generate_decodes_text(tmp_path, corpus, cache, capsys):
    config = _config(tmp_path, corpus, data={"tokenizer": BPE}, train={"steps": 3})
    assert main(["train", config]) == 0
    run_dir = tmp_path / "runs" / "t"
    assert "vocab_size = 320" in (run_dir / "config.toml").read_text()
    assert (run_dir / "tokenizer.json").is_file()
    for cached in cache.rglob("tokenizer.json"):  # generate reads the run's own copy
        cached.unlink()
    capsys.readouterr()
    assert main(["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > len("def \n")
