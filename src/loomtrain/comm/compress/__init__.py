"""Gradient compressors behind one interface (base.py), one file per method: topk, randomk,
powersgd, int8, sign.

`build_compressor` turns a method name and its settings into a compressor (None for "none").
What each method sends, its exchange and its error-feedback default: docs/compression.md.
"""

from __future__ import annotations

from loomtrain.comm.compress.base import Compressor, Exchange, relative_error
from loomtrain.comm.compress.int8 import Int8
from loomtrain.comm.compress.powersgd import PowerSGD
from loomtrain.comm.compress.randomk import RandomK
from loomtrain.comm.compress.sign import Sign
from loomtrain.comm.compress.topk import TopK

METHODS = ("none", "topk", "randomk", "powersgd", "int8", "sign")


def build_compressor(method: str, ratio: float, rank: int, error_feedback: bool, seed: int,
                     *, scheme: str = "auto") -> Compressor | None:
    """The compressor for `method`: `ratio` is read by topk and randomk (the fraction of values
    sent, in (0, 1]), `rank` by powersgd (>= 1), `seed` by randomk and powersgd (it must be the
    same on every rank), `scheme` by topk (comm/sparse.py). ValueError for a bad one."""
    if method not in METHODS:
        raise ValueError(f"compression method {method!r} is not one of {METHODS}")
    if method == "topk":
        return TopK(ratio, error_feedback, scheme)
    if method == "randomk":
        return RandomK(ratio, error_feedback, seed)
    if method == "powersgd":
        return PowerSGD(rank, error_feedback, seed)
    if method == "int8":
        return Int8(error_feedback)
    if method == "sign":
        return Sign(error_feedback)
    return None


__all__ = ["METHODS", "Compressor", "Exchange", "Int8", "PowerSGD", "RandomK", "Sign", "TopK",
           "build_compressor", "relative_error"]
