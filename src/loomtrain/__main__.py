"""`python -m loomtrain ...` (what torchrun runs on every node) is the `loom` command."""

from loomtrain.cli import entry

entry()
