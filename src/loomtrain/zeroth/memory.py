"""Peak memory of inference, a MeZO step and backprop steps, measured on one model: on CPU the
process's peak resident size per phase (reset through /proc/self/clear_refs), on CUDA the
allocator's peak. What each phase includes and how a fresh process makes the figures stable
(`measure_in_subprocess`): docs/zeroth.md, "Memory".
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import torch

PHASES = ("inference", "mezo", "backprop_sgd", "backprop_adamw")


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status (Linux only)")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak() -> None:
    """Make VmHWM equal to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def _run_phase(phase: str, model, x, y, lr: float) -> None:
    from loomtrain.models import token_loss_sum
    from loomtrain.zeroth import build_zo_optimizer

    def loss_fn():
        return token_loss_sum(model(x), y) / y.numel()

    if phase == "inference":
        with torch.no_grad():
            loss_fn()
    elif phase == "mezo":
        build_zo_optimizer("mezo", model, lr=lr).step(loss_fn)
    else:
        cls = torch.optim.SGD if phase == "backprop_sgd" else torch.optim.AdamW
        opt = cls(model.parameters(), lr=lr)
        for _ in range(2):
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        del opt


def measure(model_cfg: dict, batch: int, phases=PHASES, device: str = "cpu",
            seed: int = 0, lr: float = 1e-6) -> dict:
    """Peak bytes of each phase on the model of `model_cfg` (loomtrain's [model] keys) with a
    batch of `batch` full-length rows, in this process; plus "params" and "param_bytes"."""
    from loomtrain.models import build_model
    from loomtrain.models.config import ModelConfig

    cfg = ModelConfig(**model_cfg)
    dev = torch.device(device)
    torch.manual_seed(seed)

    def make(c):
        model = build_model(c).to(dev)
        x = torch.randint(0, c.vocab_size, (batch, c.seq_len), device=dev)
        return model, x, torch.randint(0, c.vocab_size, (batch, c.seq_len), device=dev)

    warm = make(cfg.model_copy(update={"n_layers": 1}))
    for phase in phases:
        _run_phase(phase, *warm, lr)
    del warm
    gc.collect()
    cuda = dev.type == "cuda"
    base = torch.cuda.memory_allocated(dev) if cuda else rss_bytes()
    model, x, y = make(cfg)
    out = {"params": sum(p.numel() for p in model.parameters()),
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    for phase in phases:
        gc.collect()
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        else:
            reset_peak()
        _run_phase(phase, model, x, y, lr)
        if cuda:
            torch.cuda.synchronize(dev)
        out[phase] = (torch.cuda.max_memory_allocated(dev) if cuda else peak_bytes()) - base
    return out


def measure_in_subprocess(model_cfg: dict, batch: int, phases=PHASES, device: str = "cpu",
                          threads: int = 1, timeout_s: float = 600.0) -> dict:
    """`measure` in a fresh Python process (docs/zeroth.md), with `threads` torch threads."""
    args = json.dumps({"model_cfg": model_cfg, "batch": batch, "phases": list(phases),
                       "device": device, "threads": threads})
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-m", "loomtrain.zeroth.memory", args], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"memory measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec.pop("threads"))
    print(json.dumps(measure(**spec)))
