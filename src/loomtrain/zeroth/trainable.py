"""`optim.trainable`: which parameters a zeroth-order run perturbs and steps, by name
(prefixes or globs); used by the run (train.py) and the dry run (estimate.py)."""

from __future__ import annotations

import fnmatch

import torch.nn as nn

from loomtrain.errors import ConfigError


def _matches(name: str, pattern: str) -> bool:
    """A glob (with * ? or [) matches the whole name; anything else is a prefix of it."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name.startswith(pattern)


def select_trainable(model: nn.Module, patterns: list[str],
                     whole: nn.Module | None = None) -> list[nn.Parameter]:
    """The parameters whose names (any of a tied parameter's names) match a pattern, in model
    order, each once; all of them for no pattern. A pattern that matches nothing of `whole`
    (default: `model`; a split model's part may hold none of what it matches) is a
    ConfigError naming the model's parameters."""
    named = list(model.named_parameters(remove_duplicate=False))
    if not patterns:
        return list(dict.fromkeys(p for _, p in named))
    names = [name for name, _ in (whole or model).named_parameters(remove_duplicate=False)]
    for pattern in patterns:
        if not any(_matches(name, pattern) for name in names):
            shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
            raise ConfigError(f"optim.trainable: {pattern!r} matches no parameter of the model; "
                              f"its parameters are {shown}. Give name prefixes (\"blocks.1.\": "
                              "everything under blocks.1) or globs (\"*.bias\", whole names)")
    return list(dict.fromkeys(p for name, p in named if any(_matches(name, pat) for pat in patterns)))
