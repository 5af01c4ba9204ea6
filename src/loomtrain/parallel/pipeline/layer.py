"""A pipeline layer: what `layers_of` (split.py) and the Hugging Face reader (hf_layers.py)
return, the unit a stage is cut from (docs/pipeline.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Layer:
    name: str
    owns: tuple[str, ...]  # module paths of the model this layer computes with
    run: Callable  # run(model, x) -> y
