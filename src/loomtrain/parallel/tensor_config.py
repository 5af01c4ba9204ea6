"""The tensor-parallel component's keys and rules (parallel/tensor.py)."""

from __future__ import annotations

from pydantic import Field

from loomtrain.component import SPLIT, Built, Component, Section, Switch


class TensorKeys(Section):
    tp: int = Field(1, ge=1)
    # tensor parallel: layer norms and dropout on 1/tp of the sequence (Megatron-style)
    sequence_parallel: bool = False


class TensorParallel(Component):
    """tp must split whole attention heads and the MLP's hidden width (the vocabulary is
    padded to a multiple of tp: `padded_vocab`); the llama's kv heads are split or
    replicated; sequence parallelism splits the sequence."""

    name = "tensor"
    section, keys = "parallel", TensorKeys
    switches = (Switch("parallel.tp", 1),)
    summary = "Megatron column/row-parallel layers, vocabulary-parallel head and loss"
    stage = SPLIT

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.parallel import apply_tensor_parallel

        built.model, built.loss_sum = apply_tensor_parallel(built.model, built.mesh, built.cfg)

    @classmethod
    def estimate(cls, plan) -> None:
        from loomtrain.parallel.tensor_estimate import estimate_tensor

        estimate_tensor(plan)

    @classmethod
    def validate(cls, cfg) -> None:
        p, m = cfg.parallel, cfg.model
        if p.sequence_parallel and (p.tp == 1 or m.name not in ("gpt", "llama")):
            raise ValueError("parallel.sequence_parallel=true splits the layer norms of the GPT "
                             "or the llama over the tensor-parallel ranks; it needs "
                             "parallel.tp > 1 and model.name=\"gpt\" or \"llama\"")
        if p.tp == 1:
            return
        if m.linear_decay:
            # tensor parallelism re-slices the heads but not their decays (attn.decay)
            raise ValueError(f"parallel.tp={p.tp} with model.linear_decay=true is not supported "
                             "yet; use parallel.tp=1 or model.linear_decay=false")
        sizes = {"model.mlp_ratio*model.d_model": m.mlp_ratio * m.d_model}
        if m.name == "gpt":
            sizes = {"model.n_heads": m.n_heads, **sizes}
        if m.name == "llama":
            sizes = {"model.n_heads": m.n_heads, "the SwiGLU width (model.ffn_hidden)": m.ffn_width}
        if p.sequence_parallel:
            sizes["model.seq_len"] = m.seq_len
        for key, n in sizes.items():
            if n % p.tp:
                raise ValueError(f"parallel.tp={p.tp} must divide {key} = {n} (tensor parallelism "
                                 f"splits it evenly); choose parallel.tp among its divisors")
        if m.name == "llama" and m.kv_heads % p.tp and p.tp % m.kv_heads:
            # kv heads split when tp divides them, replicated when tp is a multiple of them
            # (parallel/tensor_llama.py `kv_layout`)
            raise ValueError(f"parallel.tp={p.tp} and model.n_kv_heads={m.kv_heads}: one must "
                             "divide the other (kv heads are split over tp when tp divides "
                             "them, replicated when tp is a multiple of them); choose "
                             f"parallel.tp among the divisors or multiples of {m.kv_heads}")
