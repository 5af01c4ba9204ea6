"""Does a sparse weight make a layer faster or smaller on this CPU? Dense matmul against
torch.sparse CSR at the default GPT's layer sizes, and whether 2:4 semi-structured kernels run.

    .venv/bin/python benchmarks/sparse_kernels.py [--reps 20] [--threads 1] [--quick]

Layers: the default GPT's (d_model 256, mlp_ratio 4) nn.Linear weights, (out, in) = (768,
256) qkv, (256, 256) attention proj, (1024, 256) MLP fc, (256, 1024) MLP proj, applied to one
micro-batch of tokens (micro_batch 8 x seq_len 128 = 1024 rows; --quick: 64 rows, two
layers). Each weight is pruned to a random mask at density 0.5, 0.2 and 0.1 (where the
pattern sits matters little to CSR; what is kept does not matter to the time).

Times (forward only, y = x W^T; the median of `reps` calls after 3 warm-up calls, dense and
CSR alternating, in one process with `threads` torch threads):
- dense_ms: `F.linear(x, W)` with the masked (zero-filled) dense W: what training runs;
- csr_ms: `W_csr @ x^T` with W as a torch.sparse CSR tensor (`W.to_sparse_csr()`), then
  transposed back: what a sparse inference kernel on this build gives.
Sizes of one weight: dense_bytes = 4 numel; csr_bytes: torch's CSR (fp32 values, int64
column indices and row pointers); csr32_bytes: the same with int32 indices; bitmap_bytes:
the kept values plus a 1-bit mask (what a checkpoint of this library holds besides the dense
weight: only the mask's bits).
semi_structured: `torch.sparse.to_sparse_semi_structured` on a 2:4 fp16 weight on this CPU:
"ok" with its time, or the error torch raises.

The last line on stdout is one JSON object: {"threads", "rows", "layers": [{shape, density,
dense_ms, csr_ms, speedup, dense_bytes, csr_bytes, csr32_bytes, bitmap_bytes}], "semi_structured"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

SHAPES = [(768, 256), (256, 256), (1024, 256), (256, 1024)]
DENSITIES = (0.5, 0.2, 0.1)


def median_ms(fn, reps: int) -> float:
    return paired_ms([fn], reps)[0]


def paired_ms(fns, reps: int) -> list[float]:
    """Each function's median milliseconds over `reps` calls after 3 warm-up calls, the
    functions alternating (A B, B A, ...) so that a change in the machine's load between
    them falls on both."""
    for fn in fns:
        for _ in range(3):
            fn()
    times = [[] for _ in fns]
    for rep in range(reps):
        order = list(range(len(fns)))[::(-1) ** rep]
        for i in order:
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def measure(shape, density: float, rows: int, reps: int, gen: torch.Generator) -> dict:
    out_f, in_f = shape
    w = torch.randn(shape, generator=gen) * 0.02
    keep = torch.randperm(w.numel(), generator=gen)[:round(density * w.numel())]
    mask = torch.zeros(w.numel(), dtype=torch.bool)
    mask[keep] = True
    w = w * mask.view(shape)
    x = torch.randn(rows, in_f, generator=gen)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore")
        csr = w.to_sparse_csr()
        y_csr = (csr @ x.t()).t()
    assert torch.allclose(y_csr, F.linear(x, w), atol=1e-5), "CSR and dense disagree"
    dense_ms, csr_ms = paired_ms([lambda: F.linear(x, w), lambda: (csr @ x.t()).t()], reps)
    nnz = int(mask.sum())
    return {"shape": list(shape), "density": density, "dense_ms": round(dense_ms, 4),
            "csr_ms": round(csr_ms, 4), "speedup": round(dense_ms / csr_ms, 3),
            "dense_bytes": 4 * w.numel(), "csr_bytes": nnz * (4 + 8) + 8 * (out_f + 1),
            "csr32_bytes": nnz * (4 + 4) + 4 * (out_f + 1),
            "bitmap_bytes": 4 * nnz + -(-w.numel() // 8)}


def semi_structured(rows: int, reps: int) -> dict:
    """2:4 through torch's semi-structured tensor, on the CPU (torch documents CUDA only)."""
    try:
        from torch.sparse import to_sparse_semi_structured

        w = torch.randn(256, 256).half()
        w = w * torch.tensor([1, 1, 0, 0], dtype=torch.half).repeat(256, 64)
        sparse = to_sparse_semi_structured(w)
        x = torch.randn(rows, 256).half()
        return {"status": "ok", "ms": round(median_ms(lambda: F.linear(x, sparse), reps), 4)}
    except Exception as err:  # the message is the finding
        return {"status": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="64 rows, two layers, 3 reps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, shapes, reps = (64, SHAPES[:2], 3) if args.quick else (1024, SHAPES, args.reps)
    gen = torch.Generator().manual_seed(0)
    layers = [measure(s, d, rows, reps, gen) for d in DENSITIES for s in shapes]
    for r in layers:
        print(f"{str(tuple(r['shape'])):>12} density {r['density']:<4} dense {r['dense_ms']:8.3f} ms "
              f"csr {r['csr_ms']:8.3f} ms (x{r['speedup']:.2f})  bytes dense {r['dense_bytes']:>8} "
              f"csr {r['csr_bytes']:>8} csr32 {r['csr32_bytes']:>8} bitmap {r['bitmap_bytes']:>8}")
    print(json.dumps({"threads": args.threads, "rows": rows, "layers": layers,
                      "semi_structured": semi_structured(rows, reps)}))


if __name__ == "__main__":
    main()
