"""Every path one CUDA GPU allows, in under 8 minutes, through `loom train` itself: fp32 and
bf16, activation offload (its copy stream and pinned host buffers) and ZeRO's optimizer
offload (pinned master state), the fused attention kernel, `train.compile` (reported "not
available" where the key is refused), each data-parallel engine at world 1 (ZeRO 0-3), and
the multi-process paths gloo carries on CUDA tensors (two ranks sharing the GPU: dp, ZeRO 3,
tp, pp, cp, ep). The fp32 runs are oracles, as in the suite: the one-GPU GPT's losses
against the same run on the CPU (within CUDA_VS_CPU_RTOL), and each two-rank layout's against
the one-GPU run of the same model and batches (within LAYOUT_RTOL). Each check is a small
function timed on its own; one that fails is
recorded and the next runs; checks the global budget (BUDGET_S) leaves no time for are
skipped. Prints one line per check on stderr, then one JSON line: every check's result and
seconds, and the default Llama's MFU (bf16, metrics.jsonl's `mfu`, the median of its
records after the first). Exit code 0: every check passed or was not available; 1: one
failed; 2: no CUDA. docs/benchmarks.md, "One GPU: benchmarks/gpu_check.py".

    python benchmarks/gpu_check.py [--budget-s 450] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from loomtrain.train.metrics import read_metrics

BUDGET_S = 450.0  # 7.5 minutes of checks: the whole script stays under 8
RUN_TIMEOUT_S = 150  # one `loom train`, compiling included
# the same fp32 maths on other kernels (cuBLAS and the fused attention against the CPU's) over 4
# AdamW steps: ~1e-6 expected; a wrong result is off by far more
CUDA_VS_CPU_RTOL = 1e-3
# a layout against one process, the suite's oracle bound (sums in another order: ~1e-7)
LAYOUT_RTOL = 1e-4
NO_CUDA = "gpu_check: CUDA is not available (torch.cuda.is_available() is False): it needs one CUDA GPU"
SMALL_GPT = {"model.name": "gpt", "model.d_model": 128, "model.n_layers": 2, "model.n_heads": 4,
             "model.seq_len": 128, "train.global_batch": 8, "train.micro_batch": 4}
SMALL_LLAMA = {"model.name": "llama", "model.d_model": 128, "model.n_layers": 2,
               "model.n_heads": 4, "model.n_kv_heads": 2, "model.seq_len": 128,
               "train.global_batch": 8, "train.micro_batch": 4}
MOE = {**SMALL_LLAMA, "model.n_experts": 4, "model.experts_per_token": 2}


class NotAvailable(Exception):
    """The path is not in this loomtrain (a refused key): reported, not a failure."""


def loom_train(root: Path, name: str, sets: dict, nproc: int = 1, steps: int = 4,
               device: str = "cuda") -> list[dict]:
    """`loom train` on the GPU (or `device`) with `sets` (and a gloo process group for nproc >
    1, every rank on the one GPU); its metrics.jsonl records. A refused key: NotAvailable;
    another failure: RuntimeError with the end of stderr."""
    base = {"run.device": device, "run.dir": str(root), "run.name": name, "run.progress": "false",
            "run.log_every": 1, "run.eval_every": 1000, "run.eval_batches": 1,
            "train.steps": steps, "train.warmup_steps": 1, "parallel.nproc": nproc,
            "parallel.timeout_s": 60}
    if nproc > 1:
        base["parallel.backend"] = "gloo"
    argv = [sys.executable, "-m", "loomtrain", "train"]
    for key, value in {**base, **sets}.items():
        argv += ["--set", f"{key}={value}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode == 2 and "unknown" in done.stderr.lower():
        raise NotAvailable(done.stderr.strip().splitlines()[-1][:300])
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-600:]}")
    records = read_metrics(root / name)
    if len(records) != steps or not all(torch.isfinite(torch.tensor(r["loss"])) for r in records):
        raise RuntimeError(f"{len(records)} records of {steps}, or a loss not finite")
    return records


def max_rel_diff(got: list[dict], want: list[dict], rtol: float, what: str) -> float:
    """The largest relative difference of two runs' losses, step by step; RuntimeError where
    the steps differ or it is over `rtol`."""
    if [r["step"] for r in got] != [r["step"] for r in want]:
        raise RuntimeError(f"{what}: steps {[r['step'] for r in got]} against "
                           f"{[r['step'] for r in want]}")
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, want))
    if not rel <= rtol:  # NaN fails too
        raise RuntimeError(f"{what}: losses differ by {rel:.3g} relative (bound {rtol:g}): "
                           f"{[r['loss'] for r in got]} against {[r['loss'] for r in want]}")
    return rel


def summary(records: list[dict]) -> dict:
    last = records[-1]
    return {"loss": round(last["loss"], 4), "tokens_per_s": round(last["tokens_per_s"]),
            "peak_mem_bytes": last["peak_mem_bytes"], "mfu": last.get("mfu")}


def check_fused_attention(root: Path) -> dict:
    """The models' attention (F.scaled_dot_product_attention) on the flash kernel alone, bf16,
    forward and backward: an error here means the fused kernel is not taken."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from loomtrain.models import build_model
    from loomtrain.models.config import ModelConfig

    model = build_model(ModelConfig(name="llama", d_model=128, n_layers=2, n_heads=4,
                                    n_kv_heads=2, seq_len=256)).cuda().bfloat16()
    idx = torch.randint(0, model_vocab(model), (2, 256), device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        logits = model(idx)
        logits.float().mean().backward()
    torch.cuda.synchronize()
    return {"kernel": "flash", "logits_finite": bool(torch.isfinite(logits).all())}


def model_vocab(model) -> int:
    return next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings


def check_llama_mfu(root: Path) -> dict:
    """The default Llama ([model] name = "llama", every other key its default) in bf16: MFU as
    metrics.jsonl records it, the median of the records after the first (warm-up)."""
    records = loom_train(root, "llama_mfu", {"model.name": "llama", "train.precision": "bf16",
                                             "train.global_batch": 32, "train.micro_batch": 8},
                         steps=20)
    mfus = [r["mfu"] for r in records[1:]]
    if any(m is None for m in mfus):
        raise RuntimeError("metrics.jsonl has mfu null: this GPU's peak is not in the planner's table")
    return {**summary(records), "mfu": statistics.median(mfus),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[1:])}


def run_check(root: Path, name: str, sets: dict, nproc: int = 1):
    return lambda: summary(loom_train(root, name, sets, nproc))


def cuda_against_cpu(root: Path, gpu: list[dict]) -> dict:
    """The one-GPU fp32 GPT's figures, its losses checked against the same run on the CPU."""
    cpu = loom_train(root, "fp32_gpt_cpu", SMALL_GPT, device="cpu")
    return {**summary(gpu), "cuda_vs_cpu_max_rel_diff":
            max_rel_diff(gpu, cpu, CUDA_VS_CPU_RTOL, "fp32_gpt against the CPU")}


def oracle_check(root: Path, name: str, sets: dict, nproc: int, reference, rtol: float):
    """A run whose losses must equal `reference()`'s (records) within `rtol`."""
    def check():
        records = loom_train(root, name, sets, nproc)
        return {**summary(records),
                "max_rel_diff": max_rel_diff(records, reference(), rtol, name)}
    return check


def memoized(fn):
    """fn() once, its result kept: a reference run shared by the checks that compare to it."""
    kept = []
    return lambda: kept[0] if kept else kept.append(fn()) or kept[0]


def checks(root: Path) -> dict:
    """Name -> a function of no arguments returning the check's figures (or raising)."""
    gpt_bf16 = {**SMALL_GPT, "train.precision": "bf16"}
    moe_fp32 = {**MOE, "parallel.ep": 1}
    # the one-GPU fp32 runs the layouts are checked against (run when first needed)
    gpt_one = memoized(lambda: loom_train(root, "gpt_one_gpu", SMALL_GPT))
    moe_one = memoized(lambda: loom_train(root, "moe_one_gpu", moe_fp32))
    found = {
        "fp32_gpt": lambda: cuda_against_cpu(root, gpt_one()),
        "bf16_gpt": run_check(root, "bf16_gpt", gpt_bf16),
        "bf16_llama": run_check(root, "bf16_llama", {**SMALL_LLAMA, "train.precision": "bf16"}),
        "fused_attention": lambda: check_fused_attention(root),
        "llama_mfu": lambda: check_llama_mfu(root),
        "compile": run_check(root, "compile", {**gpt_bf16, "train.compile": "true"}),
        "offload_activations": run_check(root, "offload_activations",
                                         {**gpt_bf16, "parallel.offload_activations": 1.0}),
        "recompute_full": run_check(root, "recompute_full", {**gpt_bf16, "parallel.recompute": "full"}),
        "moe_llama": run_check(root, "moe_llama", {**MOE, "train.precision": "bf16"}),
    }
    for stage in range(4):
        found[f"zero{stage}_world1"] = run_check(root, f"zero{stage}_world1",
                                                 {**gpt_bf16, "parallel.zero_stage": stage})
    found["zero1_offload_optimizer"] = run_check(
        root, "zero1_offload_optimizer",
        {**gpt_bf16, "parallel.zero_stage": 1, "parallel.offload_optimizer": "true"})
    two = {"dp2": {}, "zero3_dp2": {"parallel.zero_stage": 3}, "tp2": {"parallel.tp": 2},
           "pp2": {"parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.microbatches": 2},
           "cp2": {"parallel.cp": 2}}
    # fp32, against one GPU: the multi-process code on CUDA tensors gives the same losses
    for name, sets in two.items():
        found[f"gloo_{name}"] = oracle_check(root, f"gloo_{name}", {**SMALL_GPT, **sets}, 2,
                                             gpt_one, LAYOUT_RTOL)
    found["gloo_ep2"] = oracle_check(root, "gloo_ep2", {**moe_fp32, "parallel.ep": 2}, 2,
                                     moe_one, LAYOUT_RTOL)
    return found


def run_all(found: dict, budget_s: float, min_left_s: float = 20.0) -> dict:
    """Each check in order, timed, its exception caught: {"status": "pass" | "fail" |
    "not available" | "skipped (budget)", "s": seconds, and its figures or its error}."""
    t0 = time.perf_counter()
    results = {}
    for name, fn in found.items():
        if budget_s - (time.perf_counter() - t0) < min_left_s:
            results[name] = {"status": "skipped (budget)", "s": 0.0}
        else:
            start = time.perf_counter()
            try:
                results[name] = {"status": "pass", **fn()}
            except NotAvailable as err:
                results[name] = {"status": "not available", "reason": str(err)}
            except Exception as err:  # a failed check is a result: the next one runs
                results[name] = {"status": "fail", "error": f"{type(err).__name__}: {err}"[-800:]}
            results[name]["s"] = round(time.perf_counter() - start, 2)
        print(f"{name}: {results[name]['status']} ({results[name]['s']} s)", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--only", nargs="*", help="run only these checks (names as printed)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        found = checks(Path(tmp))
        unknown = sorted(set(args.only or ()) - set(found))
        if unknown:
            print(f"gpu_check: unknown check {unknown[0]!r}; the checks are {', '.join(found)}",
                  file=sys.stderr)
            return 2
        if args.only:
            found = {k: v for k, v in found.items() if k in args.only}
        results = run_all(found, args.budget_s)
    statuses = [r["status"] for r in results.values()]
    llama = results.get("llama_mfu", {})
    print(json.dumps({
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "llama_mfu": llama.get("mfu"), "llama_tokens_per_s": llama.get("tokens_per_s"),
        "passed": statuses.count("pass"), "failed": statuses.count("fail"),
        "not_available": statuses.count("not available"),
        "skipped": statuses.count("skipped (budget)"),
        "total_s": round(time.perf_counter() - t0, 1), "checks": results}))
    return 1 if "fail" in statuses else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
