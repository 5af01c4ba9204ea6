"""The [data] section (data/), and the digits classification task and the by-file partition
as components: what they do not run with."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from loomtrain.component import Component, Refusal, Section, Switch
from loomtrain.data.tokenizer import BYTES, parse

# data.source names that are not paths
BUILTIN_SOURCES = ("stdlib", "stdlib-code", "stdlib-tests", "digits")


class DataConfig(Section):
    # "stdlib": the running interpreter's standard-library .py sources ("stdlib-code": without
    # the test modules, "stdlib-tests": those alone; data/corpus.py); "digits": scikit-learn's
    # 8x8 digit images, a classification task (data/digits.py); otherwise a path to a text
    # file, a folder of text files, a JSON Lines (*.jsonl) or Parquet (*.parquet) file, or a
    # token file (*.bin / *.u16: uint16 ids, *.u32: uint32); docs/data.md
    source: str = "stdlib"
    # "bytes" (ids 0-255), "bpe:N" (a byte-level BPE of N tokens trained on the source and
    # cached) or the path of a Hugging Face tokenizer.json; model.vocab_size follows it
    # (data/tokenizer.py)
    tokenizer: str = "bytes"
    # the text of a JSON Lines record, and of a Parquet row
    text_field: str = Field("text", min_length=1)
    text_column: str = Field("text", min_length=1)
    val_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    # rows hold several documents (the source's files) and attention never crosses one;
    # docs/sequence.md
    packing: bool = False
    # dynamic hybrid dp x cp (ByteScale): documents dealt to ranks by attention work
    balance: bool = False
    # "by_file": each data-parallel or async worker trains on its own contiguous group of the
    # source's files (non-IID); data/partition.py
    partition: Literal["iid", "by_file"] = "iid"
    # "digits": only these digits, in training and validation (empty: all ten)
    classes: list[int] = []

    @model_validator(mode="after")
    def _partition_needs_files(self) -> "DataConfig":
        # a path that does not exist is left to the corpus loader, which names it
        source = self.source
        if self.partition == "by_file" and source not in BUILTIN_SOURCES \
                and Path(source).expanduser().is_file():
            raise ValueError(
                f"data.partition=\"by_file\" gives each worker its own group of the source's "
                f"files, but data.source={self.source!r} is a single file; give \"stdlib\" or a "
                f"folder of text files, or set data.partition=\"iid\"")
        return self

    @model_validator(mode="after")
    def _tokenizer_spec(self) -> "DataConfig":
        parse(self.tokenizer)
        if self.source == "digits" and self.tokenizer != BYTES:
            raise ValueError(f"data.tokenizer={self.tokenizer!r} tokenizes text; data.source="
                             "\"digits\" is images: leave it \"bytes\"")
        return self

    @model_validator(mode="after")
    def _classes_of_digits(self) -> "DataConfig":
        if self.classes and self.source != "digits":
            raise ValueError(f"data.classes={self.classes} filters the digits of data.source="
                             f"\"digits\"; data.source={self.source!r} has no classes: leave it "
                             "empty")
        if any(not 0 <= c < 10 for c in self.classes) or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"data.classes={self.classes} must be distinct digits 0-9 (empty: all "
                             "ten)")
        return self


_EXAMPLES = ("an example is 64 pixels, with no sequence, vocabulary or files to split, and the "
             "classifier runs in the data-parallel engines")


class Digits(Component):
    """data.source="digits" (train/task.py) trains the MLP classifier on whole examples, in
    the engines that split no example or layer: dp, ZeRO, low communication, compression."""

    name = "digits"
    switches = (Switch("data.source", on=("digits",)),)
    summary = "scikit-learn's digits, a classification task for the MLP classifier"
    refuses = {other: Refusal(_EXAMPLES, yet=False) for other in
               ("tensor", "pipeline", "context", "packing", "by_file", "asyncsgd")}

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.data.source == "digits" and cfg.model.name != "mlp":
            raise ValueError('data.source="digits" is a classification task, trained by the MLP '
                             f'classifier: set model.name="mlp" (got {cfg.model.name!r})')


class ByFile(Component):
    """data.partition="by_file": each data-parallel or async worker trains on its own group of
    the source's files (data/partition.py)."""

    name = "by_file"
    switches = (Switch("data.partition", "iid"),)
    summary = "each worker trains on its own group of the source's files (non-IID)"
