"""The context-parallel components' keys and rules (docs/sequence.md): context parallelism
over cp, document packing, and the dynamic hybrid dp x cp balance."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loomtrain.component import CONTEXT, Built, Component, Refusal, Section, Switch


class SequenceKeys(Section):
    cp: int = Field(1, ge=1)
    # the context-parallel kernel (docs/sequence.md); None: "ring" for softmax attention,
    # "lasp" for linear attention
    cp_method: Literal["ring", "ulysses", "lasp", "auto"] | None = None


class Context(Component):
    """The kernel matches the attention, and the row splits evenly under its layout."""

    name = "context"
    section, keys = "parallel", SequenceKeys
    switches = (Switch("parallel.cp", 1),)
    summary = "ring attention, Ulysses, LASP or automatic, over cp"
    refuses = {}
    stage = CONTEXT

    @classmethod
    def applies(cls, cfg) -> bool:
        """Also at cp = 1 when data.packing asks for document masks."""
        return cfg.parallel.cp > 1 or cfg.data.packing

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.parallel.sequence import apply_sequence, sequence_of

        built.model = apply_sequence(built.model, built.mesh, built.cfg)
        built.parts[cls.name] = sequence_of(built.model)

    @classmethod
    def estimate(cls, plan) -> None:
        from loomtrain.parallel.sequence.estimate import estimate_context

        estimate_context(plan)

    @classmethod
    def local_batch(cls, built: Built, batch: tuple) -> tuple:
        """This rank's tokens of the full rows (and their documents, noted for the kernel)."""
        return built.parts[cls.name].shard(*batch)

    @classmethod
    def describe(cls, built: Built) -> str | None:
        plan = getattr(built.parts[cls.name], "plan", None)  # cp_method="auto": what it chose
        return None if plan is None else f"automatic sequence parallelism: {plan.describe()}"

    @classmethod
    def validate(cls, cfg) -> None:
        p, m = cfg.parallel, cfg.model
        if p.cp_method is not None and p.cp == 1:
            raise ValueError(f"parallel.cp_method={p.cp_method!r} is a context-parallel setting: "
                             "it needs parallel.cp > 1")
        if p.cp == 1:
            return
        _needs_attention(cfg, f"parallel.cp={p.cp}")
        method = p.cp_method or ("lasp" if m.attention == "linear" else "ring")
        if method == "auto" and m.name != "gpt":
            raise ValueError(f'parallel.cp_method="auto" rewrites the GPT\'s traced attention; '
                             f'model.name={m.name!r} runs "ring" or "ulysses"')
        if method == "auto" and (m.attention != "softmax" or m.dropout):
            raise ValueError('parallel.cp_method="auto" rewrites the model\'s causal '
                             "scaled_dot_product_attention calls, without dropout: it needs "
                             f'model.attention="softmax" (got {m.attention!r}) and model.dropout=0 '
                             f"(got {m.dropout})")
        needs = {"ring": "softmax", "lasp": "linear"}.get(method)
        if needs is not None and m.attention != needs:
            other = "lasp" if method == "ring" else "ring"
            raise ValueError(f"parallel.cp_method={method!r} is for {needs} attention, but "
                             f"model.attention={m.attention!r}: use {other!r} or \"ulysses\"")
        if p.pp > 1 and method == "auto" and p.activation_budget_mb is not None \
                and p.schedule != "optimal":
            raise ValueError(f'parallel.cp_method="auto" under parallel.pp={p.pp} chooses only '
                             "the kernel: the pipeline recomputes per micro-batch itself, so "
                             "parallel.activation_budget_mb is for its schedule=\"optimal\"; "
                             "set parallel.recompute instead, or leave the budget unset")
        heads = m.n_heads // p.tp  # each tensor-parallel rank's heads
        if method == "ulysses" and heads % p.cp:
            have = (f"model.n_heads={m.n_heads} over parallel.tp={p.tp} leaves {heads} per "
                    f"rank, not divisible by {p.cp}" if p.tp > 1 else
                    f"model.n_heads={m.n_heads} is not divisible by {p.cp}")
            raise ValueError(f'parallel.cp_method="ulysses" gives each of parallel.cp={p.cp} ranks '
                             f'whole heads, but {have}; use "ring" or "lasp", or a cp that '
                             "divides the heads")
        pieces = 2 * p.cp if method in ("ring", "auto") else p.cp  # auto may choose ring
        if m.seq_len % pieces:
            why = "two zig-zag chunks per rank" if method != "ulysses" else "one chunk per rank"
            raise ValueError(f"model.seq_len={m.seq_len} must be divisible by {pieces} for "
                             f"parallel.cp_method={method!r} at parallel.cp={p.cp} ({why})")
        if p.sequence_parallel and (m.seq_len // p.cp) % p.tp:
            raise ValueError(f"parallel.sequence_parallel=true splits each cp rank's "
                             f"model.seq_len/parallel.cp = {m.seq_len // p.cp} tokens over "
                             f"parallel.tp={p.tp}: choose a seq_len, cp and tp that divide")


def _needs_attention(cfg, used: str) -> None:
    """The GPT's and the llama's attention take a sequence kernel (runtime.attention_modules)."""
    if cfg.model.name not in ("gpt", "llama"):
        raise ValueError(f"{used} splits or masks the attention of the GPT or the llama; "
                         f"model.name={cfg.model.name!r} has none: use model.name=\"gpt\" or "
                         '"llama"')


class Packing(Component):
    """Rows hold several documents and attention never crosses one."""

    name = "packing"
    switches = (Switch("data.packing", False),)
    summary = "documents packed in rows, attention masked at their boundaries"
    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.data.packing:
            _needs_attention(cfg, "data.packing=true")


class Balance(Component):
    """Dynamic hybrid dp x cp (ByteScale): the documents of packed rows dealt by work."""

    name = "balance"
    switches = (Switch("data.balance", False),)
    summary = "documents dealt over dp x cp by attention work (ByteScale)"
    refuses = {"async_pipeline": Refusal("the pool deals each rank its own tokens every "
                                         "micro-batch, and the asynchronous runtime streams "
                                         "micro-batches across steps as loaded, with no "
                                         "per-micro-batch context")}

    @classmethod
    def loaded_ranks(cls, cfg, mesh) -> list[int]:
        """Every rank loads the rows of the whole dp x cp pool, which the hybrid runtime deals
        out by work."""
        return list(range(mesh.size("dp")))

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        """The step's last micro-batch: its work dealt over dp x cp, and whole rows per rank."""
        sequence = built.parts[Context.name]
        return {"work_imbalance": round(sequence.imbalance, 4),
                "dp_work_imbalance": round(sequence.dp_imbalance, 4)}

    @classmethod
    def validate(cls, cfg) -> None:
        d, m, p = cfg.data, cfg.model, cfg.parallel
        if d.balance and not d.packing:
            raise ValueError("data.balance=true deals the documents of packed rows to ranks: it "
                             "needs data.packing=true")
        if d.balance and (m.attention != "softmax" or p.cp_method not in (None, "ring")):
            raise ValueError("data.balance=true splits long documents with ring attention: it "
                             f'needs model.attention="softmax" (got {m.attention!r}) and '
                             f'parallel.cp_method unset or "ring" (got {p.cp_method!r})')
