"""Inference: autoregressive decoding with a KV cache, whole or tensor-parallel."""

from loomtrain.inference.decoder import COMPRESS, Decoder, generate, pick_next, tp_axis
from loomtrain.inference.kvcache import KVCache

__all__ = ["COMPRESS", "Decoder", "KVCache", "generate", "pick_next", "tp_axis"]
