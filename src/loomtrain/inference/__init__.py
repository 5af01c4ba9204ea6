"""Inference: autoregressive decoding with a KV cache, whole or tensor-parallel, and Shift
Parallelism serving (tensor- or sequence-parallel per batch, shift.py)."""

from loomtrain.inference.decoder import COMPRESS, Decoder, generate, pick_next, tp_axis
from loomtrain.inference.kvcache import KVCache
from loomtrain.inference.shift import Request, ShiftServer

__all__ = ["COMPRESS", "Decoder", "KVCache", "Request", "ShiftServer", "generate", "pick_next", "tp_axis"]
