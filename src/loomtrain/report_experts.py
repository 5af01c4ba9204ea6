"""`loom report`'s picture of a mixture-of-experts run (RUN_DIR/experts.png), from the
`moe_*` keys of its records (parallel/expert/balance.py `figures`; docs/moe.md, "Metrics"):
the load imbalance and the balance loss over the steps, and each MoE block's share of the
tokens per expert summed over the logged steps."""

from __future__ import annotations

from loomtrain.errors import UserError

EXPERT_KEYS = ("moe_tokens_per_expert", "moe_load_imbalance", "moe_aux_loss")


def expert_records(records: list[dict], where: str) -> list[dict]:
    """The records that carry the expert metrics, checked: a list per block of the same
    number of experts in every record, and numbers. Raises UserError (`where` names the file)."""
    kept = [r for r in records if EXPERT_KEYS[0] in r]
    shape = None
    for r in kept:
        loads = r[EXPERT_KEYS[0]]
        ok = isinstance(loads, list) and loads and all(
            isinstance(row, list) and row and all(isinstance(c, (int, float)) for c in row)
            for row in loads)
        got = (len(loads), len(loads[0])) if ok else None
        if not ok or {len(row) for row in loads} != {got[1]} or shape not in (None, got):
            raise UserError(f"{where}: step {r.get('step')}'s moe_tokens_per_expert={loads!r} is "
                            "not one list of expert counts per MoE block, alike in every record")
        shape = got
        for key in EXPERT_KEYS[1:]:
            if not isinstance(r.get(key), (int, float)) or isinstance(r.get(key), bool):
                raise UserError(f"{where}: step {r.get('step')} has {key}={r.get(key)!r}, not a "
                                "number")
    return kept


def draw_experts(records: list[dict], title: str):
    """Three panels: load imbalance, balance loss, and blocks x experts token shares."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    imbalance_ax, aux_ax, share_ax = fig.subplots(1, 3)
    steps = [r["step"] for r in records]
    imbalance_ax.plot(steps, [r["moe_load_imbalance"] for r in records], ".-", color="tab:red")
    imbalance_ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    imbalance_ax.set(title="load imbalance (busiest expert / mean, worst block)", xlabel="step")
    aux_ax.plot(steps, [r["moe_aux_loss"] for r in records], ".-", color="tab:purple")
    aux_ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    aux_ax.set(title="balance loss per sequence (1: even)", xlabel="step")
    totals = [[sum(r["moe_tokens_per_expert"][b][e] for r in records)
               for e in range(len(records[0]["moe_tokens_per_expert"][b]))]
              for b in range(len(records[0]["moe_tokens_per_expert"]))]
    shares = [[c / max(sum(row), 1) for c in row] for row in totals]
    image = share_ax.imshow(shares, aspect="auto", cmap="viridis")
    share_ax.set(title="share of tokens, summed over the logged steps", xlabel="expert",
                 ylabel="MoE block", xticks=range(len(shares[0])), yticks=range(len(shares)))
    fig.colorbar(image, ax=share_ax)
    for ax in (imbalance_ax, aux_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return fig
