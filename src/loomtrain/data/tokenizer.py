"""data.tokenizer: bytes (ids 0-255), a Hugging Face `tokenizer.json`, or "bpe:N", a
byte-level BPE of N tokens trained on the source with the `tokenizers` package and cached.

The BPE cache is $XDG_CACHE_HOME/loomtrain/tokenizers (default ~/.cache/loomtrain/tokenizers),
one folder per (source identity, N, tokenizers version): training is deterministic, so the
same inputs always give the same file, and a second use reads it instead of training. A run
keeps a copy as RUN_DIR/tokenizer.json, which `loom generate` decodes with. docs/data.md.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from loomtrain.data import documents
from loomtrain.errors import ConfigError, DataError
from loomtrain.models.presets import PRESETS

BYTES = "bytes"
BYTE_VOCAB = 256
RUN_FILE = "tokenizer.json"
# text encoded at once (HFTokenizer.encode_many)
ENCODE_BYTES = 1 << 20
INSTALL = "pip install 'loomtrain[hf]' (or pip install tokenizers)"


def parse(spec: str) -> tuple[str, int | str | None]:
    """("bytes", None), ("bpe", N) or ("file", path); ValueError names the choices."""
    if spec == BYTES:
        return BYTES, None
    if spec.startswith("bpe:"):
        n = spec[4:]
        if not n.isdigit() or int(n) <= BYTE_VOCAB:
            raise ValueError(f"data.tokenizer={spec!r}: bpe:N needs a vocabulary N above "
                             f"{BYTE_VOCAB} (its 256 bytes plus the merges), e.g. \"bpe:4096\"")
        return "bpe", int(n)
    if spec.endswith(".json"):
        return "file", spec
    raise ValueError(f"data.tokenizer={spec!r}: choose \"bytes\", \"bpe:N\" (a byte-level BPE "
                     "of N tokens trained on data.source) or the path of a tokenizer.json")


class ByteTokenizer:
    """Text as its UTF-8 bytes: ids 0-255."""

    vocab_size = BYTE_VOCAB

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def encode_many(self, docs: list[bytes]) -> list[np.ndarray]:
        return [self.encode(d) for d in docs]

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer`. Bytes are read as UTF-8 (invalid sequences become U+FFFD)."""

    def __init__(self, tokenizer, path: Path):
        self.tokenizer, self.path = tokenizer, path
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, data: bytes) -> np.ndarray:
        return self.encode_many([data])[0]

    def encode_many(self, docs: list[bytes]) -> list[np.ndarray]:
        """Ids of each document, encoded in parallel by the Rust library's threads, about
        ENCODE_BYTES of text at a time: an encoding keeps every token's string and offsets
        besides its id, ~200 bytes a token, so a whole corpus at once would take gigabytes
        (1.6 GB for the stdlib's 31.5 MB, measured; docs/data.md)."""
        ids, group, size = [], [], 0
        for i, doc in enumerate(docs):
            group.append(doc.decode("utf-8", errors="replace"))
            size += len(doc)
            if size >= ENCODE_BYTES or i == len(docs) - 1:
                encoded = self.tokenizer.encode_batch(group, add_special_tokens=False)
                ids += [np.asarray(e.ids, dtype=np.int64) for e in encoded]
                group, size = [], 0
        return ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=False)


def require_tokenizers():
    """The `tokenizers` module, or the ConfigError that says how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"this data.tokenizer needs the tokenizers package: {INSTALL}") from None
    return tokenizers


def cache_root() -> Path:
    """Where bpe:N tokenizers are cached (like the planner's calibration, planner/specs.py)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "loomtrain" / "tokenizers"


def bpe_path(source: str, n: int, text_field: str, text_column: str) -> Path:
    """The cache file of the bpe:N of `source`, keyed by its identity, N, the fields that pick
    its text and the tokenizers version (training may change between versions)."""
    version = require_tokenizers().__version__
    field = {"jsonl": text_field, "parquet": text_column}.get(documents.kind_of(source), "")
    key = documents.identity(source)
    return cache_root() / f"bpe{n}-{key}-{field}-tokenizers{version}" / RUN_FILE


def train_bpe(source: str, n: int, text_field: str, text_column: str):
    """A byte-level BPE of vocabulary `n` (fewer if the source has too few pairs to merge)
    trained on the documents of `source`, streamed; GPT-2's byte-to-character map and regex
    pre-split (Radford et al. 2019), no special tokens."""
    tk = require_tokenizers()
    if documents.kind_of(source) == "tokens":
        raise ConfigError(f"data.tokenizer=\"bpe:{n}\" trains on the text of data.source, but "
                          f"{source!r} is a token file, already tokenized: name the tokenizer.json "
                          "that made it (`loom tokenize` writes it beside the file as FILE.tokenizer.json)")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=n, show_progress=False, special_tokens=[],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    texts = (d.decode("utf-8", errors="replace")
             for _, d in documents.documents(source, text_field, text_column))
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _from_file(path: Path, spec: str):
    tk = require_tokenizers()
    if not path.is_file():
        raise DataError(f"data.tokenizer={spec!r} does not exist; give the path of a Hugging "
                        "Face tokenizer.json, \"bpe:N\" or \"bytes\"")
    try:
        return HFTokenizer(tk.Tokenizer.from_file(str(path)), path)
    except Exception as err:  # the Rust library raises a bare Exception on a malformed file
        raise DataError(f"data.tokenizer={spec!r} is not a tokenizer.json the tokenizers package "
                        f"reads ({err})") from None


def _write_cache(path: Path, text: str) -> None:
    """`path` holding `text`, through a temporary file of its own and one rename: ranks that
    train the same tokenizer at once each leave a whole file, the same one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)


def load_tokenizer(spec: str, source: str, text_field: str = "text",
                   text_column: str = "text"):
    """The tokenizer `spec` names for `source`: a bpe:N is read from the cache, or trained
    there first."""
    kind, arg = parse(spec)
    if kind == BYTES:
        return ByteTokenizer()
    if kind == "file":
        return _from_file(Path(arg).expanduser(), spec)
    path = bpe_path(source, arg, text_field, text_column)
    if not path.is_file():
        tokenizer = train_bpe(source, arg, text_field, text_column)
        _write_cache(path, tokenizer.to_str())
    return _from_file(path, spec)


def data_tokenizer(data):
    """The tokenizer of a [data] section."""
    return load_tokenizer(data.tokenizer, data.source, data.text_field, data.text_column)


def run_tokenizer(run_dir: Path, data):
    """The tokenizer a run trained with: RUN_DIR/tokenizer.json if the run saved one, else the
    one its [data] section names."""
    saved = run_dir / RUN_FILE
    if data.tokenizer != BYTES and saved.is_file():
        return _from_file(saved, str(saved))
    return data_tokenizer(data)


def save_run_tokenizer(run_dir: Path, data) -> None:
    """A copy of the run's tokenizer as RUN_DIR/tokenizer.json (none for bytes), so that the
    run decodes even once the cache or the named file is gone."""
    if data.tokenizer != BYTES:
        _write_cache(run_dir / RUN_FILE, data_tokenizer(data).path.read_text())


def followed_vocab(cfg) -> int:
    """The model.vocab_size of `cfg` (the whole Config): its tokenizer's where the config left
    it at its default or its preset's (a bpe:N is trained here, once, before any process starts). ConfigError: an
    explicit vocab_size that differs from the tokenizer's, or text read as bytes with a
    vocab_size above 256 (ids 256 and up would never occur)."""
    data, model = cfg.data, cfg.model
    if data.source == "digits" or (data.tokenizer == BYTES and documents.kind_of(data.source) == "tokens"):
        return model.vocab_size  # a classifier; ids of a token file, checked on load
    if data.tokenizer == BYTES:
        if model.vocab_size > BYTE_VOCAB:
            raise ConfigError(
                f"data.source={data.source!r} is read as bytes (data.tokenizer=\"bytes\", ids "
                f"0-255), but model.vocab_size={model.vocab_size}: ids {BYTE_VOCAB} and up would "
                f"never occur; set model.vocab_size = {BYTE_VOCAB}, or a tokenizer "
                f"(data.tokenizer = \"bpe:{model.vocab_size}\" or a tokenizer.json)")
        return model.vocab_size
    size = data_tokenizer(data).vocab_size
    # a preset's vocabulary (models/presets.py) is its own tokenizer's: it yields to this one
    preset_vocab = PRESETS.get(model.preset, {}).get("vocab_size")
    explicit = "vocab_size" in model.model_fields_set and model.vocab_size != preset_vocab
    if explicit and model.vocab_size != size:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} but data.tokenizer={data.tokenizer!r} has "
            f"{size} tokens; the model's vocabulary is the tokenizer's: remove model.vocab_size "
            f"(it then follows the tokenizer) or set it to {size}")
    return size
