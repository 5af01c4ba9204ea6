"""The gated feed-forward of the Llama family, dense (models/llama.py) and as a mixture of
experts' shared experts (models/moe.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer, arXiv 2002.05202)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    @property
    def proj(self) -> nn.Module:
        """The output projection under the GPT's name (inference/nanobatch.py walks it)."""
        return self.down_proj

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))
