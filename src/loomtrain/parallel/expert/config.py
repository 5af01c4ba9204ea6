"""The mixture-of-experts component (docs/moe.md): on when model.n_experts > 0. Its keys are the
model's (models/config.py); it owns the routers' step: the balance loss's weight before it, the
counts, metrics and bias update after it."""

from __future__ import annotations

from loomtrain.component import FINISH, Built, Component, Refusal, Switch

_NOT_YET = ("the mixture of experts runs with data parallelism and ZeRO today; expert "
            "parallelism and the other axes come next")


class Experts(Component):
    """The routers' bookkeeping over each step (parallel/expert/balance.py)."""

    name = "experts"
    switches = (Switch("model.n_experts", 0),)
    summary = "mixture-of-experts feed-forwards: balance loss, bias balancing, expert metrics"
    stage = FINISH
    refuses = {
        **{other: Refusal(_NOT_YET) for other in ("tensor", "pipeline", "async_pipeline",
                                                   "context", "balance")},
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
        from loomtrain.parallel.expert.balance import TOKEN_AXES, moe_layers

        layers = len(moe_layers(plan.model))
        payload = 8 * layers * (plan.cfg.model.n_experts + 2)
        for axis in TOKEN_AXES:
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
        from loomtrain.parallel.expert.balance import step_figures, update_bias

        part = built.parts[cls.name]
        part["seen"] = step_figures(part["layers"], built.mesh)
        if built.cfg.model.router_bias_rate and part["seen"] is not None:
            update_bias(part["layers"], part["seen"], built.cfg.model.router_bias_rate)

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        from loomtrain.parallel.expert.balance import figures

        seen = built.parts[cls.name]["seen"]
        return {} if seen is None else figures(seen)
