"""The mixture-of-experts component (docs/moe.md): on when model.n_experts > 0. Its keys are the
model's (models/config.py); it owns the routers' step: the balance loss's weight before it, the
counts, metrics and bias update after it."""

from __future__ import annotations

from pydantic import Field

from loomtrain.component import FINISH, SPLIT, Built, Component, Refusal, Section, Switch

_NOT_YET = ("the mixture of experts runs with data parallelism, ZeRO, tensor and expert "
            "parallelism today; the other axes come next")


class Experts(Component):
    """The routers' bookkeeping over each step (parallel/expert/balance.py)."""

    name = "experts"
    switches = (Switch("model.n_experts", 0),)
    summary = "mixture-of-experts feed-forwards: balance loss, bias balancing, expert metrics"
    stage = FINISH
    refuses = {
        **{other: Refusal(_NOT_YET) for other in ("pipeline", "async_pipeline", "context",
                                                   "balance")},
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
        from loomtrain.parallel.expert.balance import moe_layers

        built.parts[cls.name] = {"layers": moe_layers(built.model), "seen": None}

    @classmethod
    def estimate(cls, plan) -> None:
        """The step's counts all-reduced over the token axes: [layers, experts + 2] float64
        (balance.py `step_figures`); the activations are the model's (activations.py)."""
        from loomtrain.estimate import all_reduce
        from loomtrain.parallel.expert.balance import moe_layers, token_axes

        layers = len(moe_layers(plan.model))
        payload = 8 * layers * (plan.cfg.model.n_experts + 2)
        for axis in token_axes(plan.cfg.parallel):
            n = plan.mesh.size(axis)
            if n > 1 and layers:
                plan.collectives.append(all_reduce("expert loads and balance loss", axis, n,
                                                   payload))

    @classmethod
    def before_step(cls, built: Built, step: int) -> None:
        from loomtrain.parallel.expert.balance import set_aux_grad

        set_aux_grad(built.parts[cls.name]["layers"], built.cfg.model.aux_loss_coef,
                     built.step_tokens)

    @classmethod
    def after_step(cls, built: Built, done: int, last: bool, loss_sum, loss_tokens: float) -> None:
        from loomtrain.parallel.expert.balance import step_figures, token_axes, update_bias

        part = built.parts[cls.name]
        part["seen"] = step_figures(part["layers"], built.mesh, token_axes(built.cfg.parallel))
        if built.cfg.model.router_bias_rate and part["seen"] is not None:
            update_bias(part["layers"], part["seen"], built.cfg.model.router_bias_rate)

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
        "zero": Refusal("hierarchical ZeRO would shard the experts inside a node of edp ranks; "
                        "not built yet", when=lambda cfg: cfg.parallel.hierarchical,
                        partly="hierarchical"),
        "compression": Refusal("the compressors reduce every bucket over dp; expert buckets "
                               "reduce over edp (not built yet)"),
        "recompute": Refusal("recomputing a block would rerun its all-to-alls, which the dry "
                             "run does not count yet"),
        "offload": Refusal("not checked with the all-to-all dispatch yet"),
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


def exchange_collectives(plan) -> None:
    """The all-to-alls of expert parallelism over ep (parallel/expert/exchange.py), per MoE
    block and micro-batch of T = micro_batch * seq_len tokens (over tp under sequence
    parallelism: each tp rank exchanges its piece of the sequence; without it every tp rank
    exchanges the same tokens in its own ep group), k picks each, width d, c bytes a value:
    the counts ([ep, E/ep] int64, 8E bytes) in the forward; the rows T k d c in
    four exchanges, the forward's dispatch and combine and their two gradients in the backward.
    A dispatch sends this rank's T k rows; a combine sends back the rows it received, T k
    on average over the ep ranks (exactly T k under even routing): the payload and wire
    bytes of the rows are those of balanced routing, (ep - 1) / ep of the payload on the wire
    (comm/ counts the rows actually sent). Evaluation forwards run the counts, the dispatch
    and the combine."""
    from loomtrain.estimate import metered
    from loomtrain.parallel.expert.balance import moe_layers

    cfg, ep = plan.cfg, plan.mesh.size("ep")
    layers = len(moe_layers(plan.model))
    tokens = cfg.train.micro_batch * cfg.model.seq_len
    if cfg.parallel.sequence_parallel:
        tokens //= cfg.parallel.tp
    rows = tokens * cfg.model.experts_per_token * cfg.model.d_model * plan.compute_bytes
    counts = 8 * cfg.model.n_experts
    micro = cfg.accumulation_steps * layers
    plan.collectives += [
        metered("expert counts (all-to-all)", "all_to_all", "ep", ep, counts, micro),
        metered("expert dispatch and combine, forward and backward", "all_to_all", "ep", ep,
                rows, 4 * micro)]
    forwards = plan.eval_forwards * layers
    plan.eval_collectives += [
        metered("expert counts, evaluation", "all_to_all", "ep", ep, counts, forwards,
                every=cfg.run.eval_every),
        metered("expert dispatch and combine, evaluation", "all_to_all", "ep", ep, rows,
                2 * forwards, every=cfg.run.eval_every)]
