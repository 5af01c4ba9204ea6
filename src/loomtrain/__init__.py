"""loomtrain: train neural networks across many devices with little memory and communication."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`loomtrain.generate`, imported on first use, so `import loomtrain` (the CLI's first
    step) does not import torch."""
    if name == "generate":
        from loomtrain.inference import generate
        return generate
    raise AttributeError(f"module 'loomtrain' has no attribute {name!r}")
