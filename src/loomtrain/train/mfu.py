"""Model FLOPs utilization (MFU) of a run: the model FLOPs its tokens needed per second over
the peak its devices could reach (Chowdhery et al. 2022, PaLM, appendix B). The FLOPs per
token are the planner's (planner/cost.py `model_flops_per_step`: forward and backward, a MoE
token's k of the E experts, attention over the full causal square, no recomputation); the
peak is the planner's device spec: a built-in GPU matched by its CUDA name, on CPU the
`cpu-here` peak `loom bench calibrate` measured. docs/training.md, "MFU".
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

import torch

from loomtrain.planner.cost import model_flops_per_step
from loomtrain.planner.presets import from_model_config
from loomtrain.planner.specs import BUILTIN, calibration_path, device_from_table

NO_CALIBRATION = "no calibration: run loom bench calibrate"


@dataclass(frozen=True)
class Utilization:
    """What turns a record's global tokens/s into its MFU: `flops_per_token` (model FLOPs of
    one trained token), `peak_flops` (one device's, in the run's precision) and `devices`;
    where either figure is unknown, `missing` says why (the progress line shows it)."""

    flops_per_token: float | None
    peak_flops: float | None
    devices: int
    missing: str = ""

    def mfu(self, tokens_per_s: float) -> float | None:
        """Achieved model FLOP/s over the devices' peak; None where a figure is unknown."""
        if self.missing:
            return None
        return tokens_per_s * self.flops_per_token / (self.peak_flops * self.devices)

    def describe(self, mfu: float | None) -> str:
        """The progress line's field: "mfu 12.3%", or "mfu n/a (why)"."""
        return f"mfu {mfu:.1%}" if mfu is not None else f"mfu n/a ({self.missing or 'unknown'})"


def model_flops_per_token(model_cfg) -> float:
    """The planner's training FLOPs (forward and backward) of one token of the [model]
    section's GPT or llama; ValueError for a model the planner does not count (the MLP)."""
    shape = from_model_config(model_cfg)
    return model_flops_per_step(shape, 1) / shape.seq_len


def cuda_kind(device_name: str) -> str | None:
    """The built-in spec (planner/specs.py BUILTIN) of a `torch.cuda.get_device_name`, or None
    where none holds it: A100s (every form: 312 TFLOP/s bf16), H100 SXM and H200 (the SXM
    datasheets'); the H100 PCIe and NVL have lower peaks (756 and 835 TFLOP/s bf16 dense,
    NVIDIA H100 datasheet) and are not in the table."""
    name = device_name.lower()
    if "a100" in name:
        return "a100-80g" if "80g" in name else "a100-40g"
    if "h200" in name:
        return "h200-141g"
    if "h100" in name and "pcie" not in name and "nvl" not in name:
        return "h100-80g"
    return None


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(one device's peak FLOP/s in `precision`, or None and why): on CUDA the built-in spec of
    the GPU's name, on CPU the saved `cpu-here` calibration (never a guess)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = cuda_kind(name)
        if kind is None:
            return None, f"no peak known for {name!r}"
        return BUILTIN[kind].peak_flops(precision), ""
    path = calibration_path()
    if not path.is_file():
        return None, NO_CALIBRATION
    try:
        spec = device_from_table(tomllib.loads(path.read_text()), str(path))
    except (ValueError, tomllib.TOMLDecodeError) as err:
        return None, f"unreadable calibration {path}: {err}"
    return spec.peak_flops(precision), ""


def run_utilization(cfg, device: torch.device, devices: int) -> Utilization:
    """The run's Utilization: `devices` processes (ranks) on `device`'s kind, each counted as
    one device of the peak, as the planner counts them."""
    try:
        per_token = model_flops_per_token(cfg.model)
    except ValueError:
        return Utilization(None, None, devices, f"no FLOPs count for model.name={cfg.model.name!r}")
    if getattr(cfg.model, "attention", "softmax") != "softmax":
        return Utilization(None, None, devices, "the FLOPs count is softmax attention's")
    peak, missing = peak_flops(device, cfg.train.precision)
    return Utilization(per_token, peak, devices, missing)


__all__ = ["NO_CALIBRATION", "Utilization", "cuda_kind", "model_flops_per_token", "peak_flops",
           "run_utilization"]
