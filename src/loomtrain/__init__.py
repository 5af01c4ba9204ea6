"""loomtrain: train neural networks across many devices with little memory and communication."""

__version__ = "0.1.0"
