"""The mixture-of-experts component (docs/moe.md): on when model.n_experts > 0. Its keys are the
model's (models/config.py); it owns the routers' step: the balance loss's weight before it, the
counts, metrics and bias update after it."""

from __future__ import annotations

from pydantic import Field

from loomtrain.component import FINISH, SPLIT, Built, Component, Refusal, Section, Switch


class Experts(Component):
    """The routers' bookkeeping over each step (parallel/expert/balance.py)."""

    name = "experts"
    switches = (Switch("model.n_experts", 0),)
    summary = "mixture-of-experts feed-forwards: balance loss, bias balancing, expert metrics"
    stage = FINISH
    refuses = {
        "async_pipeline": Refusal("its stream runs a micro-batch's backward, where the routers "
                                  "count their loads and the balance loss takes its weight, in "
                                  "a later step than its forward: a step's expert figures and "
                                  "the loss's weight would mix two steps' micro-batches (not "
                                  "built yet)"),
        "context": Refusal("under Megatron's sequence parallelism a tp rank holds a piece of a "
                           "cp rank's piece of each row: the balance loss's per-row sums would "
                           "have to add both splits (not built yet); cp runs with tp without "
                           "it", when=lambda cfg: cfg.parallel.sequence_parallel,
                           partly="with sequence_parallel"),
        "asyncsgd": Refusal("the parameter server's workers route on stale weights and the "
                            "server has no step at which to agree on the experts' loads yet"),
        "zeroth": Refusal("the routers' counts and balance loss are taken in the backward, "
                          "which a zeroth-order step does not run"),
        "lowcomm": Refusal("each replica would move its routers' biases by its own loads "
                           "between syncs; not checked yet"),
        "sparsity": Refusal("the masks cover nn.Linear weights: the stacked experts would stay "
                            "dense (not built yet)"),
    }

    @classmethod
    def apply(cls, built: Built) -> None:
        """This rank's MoE layers (a pipeline stage's own) and their rows among all the
        model's; what a backward at build counted (the pipeline's timing or profile of its
        stages) is forgotten. Each layer's balance loss takes whole rows where the sequence
        runtime splits them over ranks (context parallelism, data.balance's pool)."""
        from loomtrain.parallel.expert.balance import moe_layers, moe_rows
        from loomtrain.parallel.sequence import sequence_of

        layers, runtime = moe_layers(built.model), sequence_of(built.model)
        for layer in layers:
            layer.counted = None
            if runtime is not None:
                layer.split_rows = runtime.shared_rows
        built.parts[cls.name] = {"layers": layers, "rows": moe_rows(built.model, built.cfg.model),
                                 "seen": None}

    @classmethod
    def estimate(cls, plan) -> None:
        """The step's counts all-reduced over the token axes and the block axes: [MoE blocks,
        experts + 2] float64 (balance.py `step_figures`); where the rows are split over ranks,
        each of this rank's layers' picks and probabilities per row ([rows, 2 experts] fp32,
        `balance_loss`) all-reduced in every forward of a step that computes gradients
        (recomputed ones too). The activations are the model's (activations.py)."""
        from loomtrain.estimate import all_reduce, metered, recomputed_microbatches
        from loomtrain.models.moe import moe_blocks
        from loomtrain.parallel.expert.balance import BLOCK_AXES, moe_layers, token_axes
        from loomtrain.parallel.sequence import rows_axis

        cfg = plan.cfg
        blocks, layers = len(moe_blocks(cfg.model)), len(moe_layers(plan.model))
        experts, shared = cfg.model.n_experts, rows_axis(cfg)
        for axis in (*token_axes(plan.mesh, cfg.parallel), *BLOCK_AXES):
            n = plan.mesh.size(axis)
            if n > 1 and blocks:
                plan.collectives.append(all_reduce("expert loads and balance loss", axis, n,
                                                   8 * blocks * (experts + 2)))
        if layers and shared is not None and plan.mesh.size(shared) > 1:
            rows = plan.loaded * cfg.train.micro_batch  # what `shard` is given
            forwards = cfg.accumulation_steps + recomputed_microbatches(plan)
            plan.collectives.append(metered(
                "expert picks and probabilities per row (balance loss)", "all_reduce", shared,
                plan.mesh.size(shared), 4 * rows * 2 * experts, layers * forwards))

    @classmethod
    def before_step(cls, built: Built, step: int) -> None:
        from loomtrain.parallel.expert.balance import set_aux_grad

        set_aux_grad(built.parts[cls.name]["layers"], built.cfg.model.aux_loss_coef,
                     built.step_tokens)

    @classmethod
    def after_step(cls, built: Built, done: int, last: bool, loss_sum, loss_tokens: float) -> None:
        from loomtrain.parallel.expert.balance import step_figures, token_axes, update_bias

        part = built.parts[cls.name]
        part["seen"] = step_figures(part["layers"], part["rows"], built.cfg.model, built.mesh,
                                    token_axes(built.mesh, built.cfg.parallel))
        if built.cfg.model.router_bias_rate and part["seen"] is not None:
            update_bias(part["layers"], part["seen"][part["rows"]],
                        built.cfg.model.router_bias_rate)

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        from loomtrain.parallel.expert.balance import figures

        seen = built.parts[cls.name]["seen"]
        return {} if seen is None else figures(seen)


class ExpertKeys(Section):
    ep: int = Field(1, ge=1)  # expert parallel: the dp ranks that split each block's experts


class ExpertParallel(Component):
    """parallel.ep: each MoE block's experts split over ep ranks of dp, tokens exchanged by
    all-to-all (parallel/expert/dispatch.py); expert gradients reduced over "edp"."""

    name = "expert_parallel"
    section, keys = "parallel", ExpertKeys
    switches = (Switch("parallel.ep", 1),)
    summary = "the experts split over ep ranks of dp, tokens dispatched by all-to-all"
    stage = SPLIT + 5  # after tensor parallelism, before the pipeline split (DESIGN.md)
    refuses = {
        "balance": Refusal("the pool deals each rank as many tokens as its documents come "
                           "to (split ones padded), so the all-to-alls carry other bytes than "
                           "the dry run counts (not modelled yet); ep runs with plain context "
                           "parallelism"),
        "context": Refusal("hierarchical ZeRO would shard the experts over edp and cp inside a "
                           "node, a group not built yet; flat ZeRO runs with ep and cp",
                           when=lambda cfg: cfg.parallel.hierarchical,
                           partly="with hierarchical ZeRO"),
    }

    @classmethod
    def apply(cls, built: Built) -> None:
        from loomtrain.parallel.expert.dispatch import apply_expert_parallel

        built.model = apply_expert_parallel(built.model, built.mesh)

    @classmethod
    def estimate(cls, plan) -> None:
        """Rank 0's experts (n_experts / ep per block: the memory counts them), and the
        all-to-alls, counted once the compute dtype is known (`exchange_collectives`)."""
        from loomtrain.parallel.expert.dispatch import apply_expert_parallel

        plan.model = apply_expert_parallel(plan.model, plan.mesh)
        plan.later.append(exchange_collectives)

    @classmethod
    def validate(cls, cfg) -> None:
        p, m = cfg.parallel, cfg.model
        if p.ep == 1:
            return
        if not m.n_experts:
            raise ValueError(f"parallel.ep={p.ep} splits the experts of a mixture of experts; "
                             "set model.n_experts (and model.name=\"llama\") or parallel.ep=1")
        for key, n in (("parallel.dp", p.dp_size), ("model.n_experts", m.n_experts)):
            if n % p.ep:
                raise ValueError(f"parallel.ep={p.ep} must divide {key} = {n} (the ep ranks "
                                 "are a sub-axis of dp and hold n_experts / ep experts each); "
                                 f"choose parallel.ep among its divisors")
        if p.hierarchical and not within_nodes(p, p.ep):
            fits = [e for e in range(1, p.dp_size + 1)
                    if p.dp_size % e == 0 and m.n_experts % e == 0 and within_nodes(p, e)]
            raise ValueError(
                f"parallel.ep={p.ep} with parallel.hierarchical=true: the hierarchical layout "
                "keeps each expert-parallel group inside a node (its all-to-alls on the node's "
                "links; the experts' replicas, edp, sharded inside the node and reduced across "
                f"nodes), but ep groups of {p.ep} dp ranks span nodes of "
                f"parallel.ranks_per_node={p.ranks_per_node or p.nproc} ranks; choose parallel.ep "
                f"among {fits}, or set parallel.hierarchical=false")


def within_nodes(p, ep: int) -> bool:
    """Whether every ep group (mesh.py `expert_groups`) of the [parallel] keys `p` lies on
    one node of `ranks_per_node` ranks. Pure."""
    from loomtrain.mesh import expert_groups

    sizes = {"pp": p.pp, "dp": p.dp_size, "cp": p.cp, "tp": p.tp}
    per_node = p.ranks_per_node or p.nproc
    return all(len({r // per_node for r in group}) == 1
               for group in expert_groups(sizes, ep)[0])


def exchange_collectives(plan) -> None:
    """The all-to-alls of expert parallelism over ep (parallel/expert/exchange.py), per MoE
    block and micro-batch of T = micro_batch * seq_len tokens (a cp rank's share of each row,
    seq_len / cp; over tp too under sequence parallelism: each tp rank exchanges its piece of
    the sequence; without it every tp rank exchanges the same tokens in its own ep group), k
    picks each, width d, c bytes a value: the counts ([ep, E/ep] int64, 8E bytes) in the
    forward; the rows T k d c in four exchanges, the forward's dispatch and combine and their
    two gradients in the backward.
    A dispatch sends this rank's T k rows; a combine sends back the rows it received, T k
    on average over the ep ranks (exactly T k under even routing): the payload and wire
    bytes of the rows are those of balanced routing, (ep - 1) / ep of the payload on the wire
    (comm/ counts the rows actually sent). A micro-batch whose blocks are recomputed
    (`recomputed_microbatches`) runs their forward again in its backward: the counts, the
    dispatch and the combine once more. Evaluation forwards run the counts, the dispatch
    and the combine."""
    from loomtrain.estimate import metered, recomputed_microbatches
    from loomtrain.parallel.expert.balance import moe_layers

    cfg, ep = plan.cfg, plan.mesh.size("ep")
    layers = len(moe_layers(plan.model))
    tokens = cfg.train.micro_batch * plan.local_model.seq_len
    if cfg.parallel.sequence_parallel:
        tokens //= cfg.parallel.tp
    rows = tokens * cfg.model.experts_per_token * cfg.model.d_model * plan.compute_bytes
    counts = 8 * cfg.model.n_experts
    micro = cfg.accumulation_steps * layers
    runs = micro + recomputed_microbatches(plan) * layers  # forwards and their reruns
    plan.collectives += [
        metered("expert counts (all-to-all), each forward and rerun", "all_to_all", "ep", ep,
                counts, runs),
        metered("expert dispatch and combine, each forward and rerun, and their gradients",
                "all_to_all", "ep", ep, rows, 2 * runs + 2 * micro)]
    forwards = plan.eval_forwards * layers
    plan.eval_collectives += [
        metered("expert counts, evaluation", "all_to_all", "ep", ep, counts, forwards,
                every=cfg.run.eval_every),
        metered("expert dispatch and combine, evaluation", "all_to_all", "ep", ep, rows,
                2 * forwards, every=cfg.run.eval_every)]
