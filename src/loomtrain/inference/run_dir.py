"""`loom generate RUN_DIR`: decode text with the newest checkpoint of a `loom train` run.

A checkpoint of any layout is consolidated, loaded into the GPT of the run's config and split
over `tp` ranks; the prompt is encoded and the tokens decoded by the run's tokenizer (bytes,
or RUN_DIR/tokenizer.json: data/tokenizer.py). The request is checked before any worker
starts. Details: docs/generate.md.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loomtrain.data.tokenizer import BYTE_VOCAB, BYTES, run_tokenizer
from loomtrain.errors import CheckpointError, ConfigError, UserError
from loomtrain.inference.decoder import COMPRESS, generate


@dataclass(frozen=True)
class GenerateRequest:
    run_dir: str
    prompt: str = "\n"
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = None
    seed: int = 0
    tp: int = 1
    compress: str = "none"
    overlap: bool = False
    samples: int = 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_vocab(run_dir: Path, data, model):
    """The run's tokenizer, if its vocabulary is the model's."""
    if data.tokenizer == BYTES and model.vocab_size != BYTE_VOCAB:
        raise ConfigError(f"a text prompt is bytes, but {str(run_dir)!r} has model.vocab_size="
                          f"{model.vocab_size} (byte-level text needs {BYTE_VOCAB}, its tokens "
                          "came from a token file: name the tokenizer.json that made them in "
                          "its data.tokenizer)")
    tokenizer = run_tokenizer(run_dir, data)
    if tokenizer.vocab_size != model.vocab_size:
        raise ConfigError(f"{str(run_dir)!r} has model.vocab_size={model.vocab_size}, but its "
                          f"tokenizer (data.tokenizer={data.tokenizer!r}) has "
                          f"{tokenizer.vocab_size} tokens: it is not the one the run trained with")
    return tokenizer


def check_request(req: GenerateRequest):
    """(the [model] config, the checkpoint folder, the run's tokenizer) for `req`, or a
    UserError naming the flag, its value and what would be valid."""
    from loomtrain.train import checkpoint
    from loomtrain.train.config import load_config

    run_dir = Path(req.run_dir)
    if not (run_dir / "config.toml").is_file():
        raise CheckpointError(f"generate {str(run_dir)!r}: no config.toml there; is it a loom run "
                              "folder (made by `loom train`)?")
    cfg = load_config(run_dir / "config.toml")
    model = cfg.model
    if not checkpoint.list_checkpoints(run_dir):
        raise CheckpointError(f"generate {str(run_dir)!r}: no complete checkpoint in "
                              f"{run_dir / 'checkpoints'}; train the run first")
    latest, _ = checkpoint.newest(run_dir, advice=f"decode with it by moving the damaged folder "
                                  f"out of {run_dir / 'checkpoints'}")
    if model.name not in ("gpt", "llama"):
        raise ConfigError(f"generate decodes GPT and llama models; {str(run_dir)!r} trained "
                          f"model.name={model.name!r}")
    if model.attention != "softmax":
        raise ConfigError(f"generate decodes with a KV cache, which model.attention="
                          f"{model.attention!r} ({str(run_dir)!r}) does not have yet")
    tokenizer = _check_vocab(run_dir, cfg.data, model)
    if req.tp < 1 or model.n_heads % req.tp:
        raise ConfigError(f"--tp {req.tp} must divide the model's heads, model.n_heads="
                          f"{model.n_heads}: choose among {_divisors(model.n_heads)}")
    kv = model.kv_heads if model.name == "llama" else model.n_heads
    if kv % req.tp and req.tp % kv:  # the llama's kv heads: split or replicated (tensor_llama.py)
        fits = [d for d in _divisors(model.n_heads) if kv % d == 0 or d % kv == 0]
        raise ConfigError(f"--tp {req.tp} must divide the model's kv heads or be a multiple of "
                          f"them, model.n_kv_heads={kv}: choose among {fits}")
    room = model.seq_len - 1
    size = len(tokenizer.encode(req.prompt.encode("utf-8")))
    unit = "bytes" if cfg.data.tokenizer == BYTES else "tokens"
    if not 1 <= size <= room:
        raise UserError(f"--prompt is {size} {unit}; the model's context is model.seq_len="
                        f"{model.seq_len} tokens and at least one must be left for a new "
                        f"token: give 1 to {room} {unit}")
    for flag, value, low in (("--max-new-tokens", req.max_new_tokens, 1),
                             ("--samples", req.samples, 1), ("--top-k", req.top_k, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} {value}: give at least {low}")
    if req.temperature < 0:
        raise UserError(f"--temperature {req.temperature}: give 0 (greedy) or more")
    if req.compress not in COMPRESS:
        raise UserError(f"--compress {req.compress!r}: choose one of {', '.join(COMPRESS)}")
    if req.overlap and req.samples < 2:
        raise UserError("--overlap splits the batch into two nano-batches, so it needs at "
                        f"least 2 sequences: give --samples 2 or more (got {req.samples})")
    return model, latest, tokenizer


def load_model(model_cfg, path: Path, mesh=None) -> torch.nn.Module:
    """The GPT or llama of checkpoint `path`, in eval mode, split over `mesh`'s tp axis if
    given."""
    from loomtrain.models import build_model
    from loomtrain.parallel.tensor import parallelize_tensor
    from loomtrain.train import checkpoint

    model = build_model(model_cfg)
    checkpoint.load_model_weights(path, model)
    if mesh is not None:
        parallelize_tensor(model, mesh)
    return model.eval()


def decode(req: GenerateRequest, mesh=None) -> dict:
    """Generate on this rank (every tp rank calls it alike): the texts and the timing."""
    model_cfg, path, tokenizer = check_request(req)
    model = load_model(model_cfg, path, mesh)
    prompt = torch.tensor(tokenizer.encode(req.prompt.encode("utf-8")).tolist(), dtype=torch.long)
    prompt = prompt.expand(req.samples, -1).contiguous()
    start = time.perf_counter()
    out = generate(model, prompt, req.max_new_tokens, temperature=req.temperature,
                   top_k=req.top_k, seed=req.seed, compress=req.compress, overlap=req.overlap)
    seconds = time.perf_counter() - start
    new = out.shape[1] - prompt.shape[1]
    return {"texts": [tokenizer.decode(row.tolist()) for row in out],
            "new_tokens": new, "ms_per_token": 1e3 * seconds / new, "seq_len": model_cfg.seq_len}


def generate_worker(request: dict) -> dict | None:
    """Entry point of each launched process (module level, plain arguments): rank 0
    returns what `decode` returns, the others None."""
    import torch.distributed as dist

    from loomtrain import comm
    from loomtrain.mesh import build_mesh
    from loomtrain.train.launch import shutdown

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    try:
        mesh = build_mesh({"tp": world})
        result = decode(GenerateRequest(**request), mesh)
    except (UserError, comm.CollectiveError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        dist.destroy_process_group()  # no barrier: a peer may be gone
        sys.exit(2 if isinstance(err, UserError) else 4)
    shutdown(mesh)
    return result if mesh.rank == 0 else None


def run(req: GenerateRequest) -> dict:
    """Check `req`, then decode in this process (tp 1) or on `req.tp` launched processes."""
    check_request(req)
    if req.tp == 1:
        return decode(req)
    from loomtrain.train.launch import launch_local
    return launch_local(req.tp, generate_worker, asdict(req))[0]


__all__ = ["GenerateRequest", "check_request", "decode", "generate_worker", "load_model", "run"]
