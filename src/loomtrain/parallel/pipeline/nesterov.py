"""The update of `schedule = "async"` for a gradient of fixed delay: Nesterov's method as
Ajanthan et al. modify it (ICML 2025, arXiv 2505.01099), and the optimizer the asynchronous
runtime steps (asynchronous.py)."""

from __future__ import annotations

import torch

from loomtrain.optim import build_optimizer


class DelayedNesterov(torch.optim.Optimizer):
    """Nesterov's method for a delayed gradient, Ajanthan et al. 2025, Eq. 10:

        d_t = gamma (w_t - w_{t-1}),   w_{t+1} = w_t + d_t - lr (1 - gamma) grad f(w_{t-tau} + d_{t-tau})

    NAG with the gradient discounted by (1 - gamma): as gamma -> 1 the look-ahead d_t lines
    up with the drift of the weights over the delay (their Prop. 1), so the momentum does the
    delay correction and the stale gradient only steers it. The stage keeps the look-ahead
    point theta_t = w_t + d_t as its weights, so its (stashed) forward is at w_{t-tau} +
    d_{t-tau}, where Eq. 10 takes the gradient g_t; with m the average m_{t+1} = gamma m_t +
    (1 - gamma) g_t (so w_{t+1} - w_t = -lr m_{t+1}), Eq. 10 reads

        theta_{t+1} = theta_t - lr (gamma m_{t+1} + (1 - gamma) g_t)

    (the form of NAdam, Dozat 2016, with a constant momentum; their code runs torch's NAdam).
    Both terms are bias-corrected as NAdam does (by 1 - gamma^(k+1) and 1 - gamma^k at update
    k), divided by sqrt(v_hat) + eps with Adam's second moment v when `beta2` is given (None:
    the plain SGD form), and weight decay is decoupled: theta <- theta (1 - lr wd)."""

    elementwise = True  # each element's update reads only its own state: ZeRO may slice it

    def __init__(self, params, lr: float, momentum: float = 0.99, beta2: float | None = 0.95,
                 eps: float = 1e-8, weight_decay: float = 0.0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            by_step: dict[float, list] = {}  # a tied parameter may have made fewer updates
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["momentum_buffer"] = torch.zeros_like(p)
                    if group["beta2"] is not None:
                        state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                by_step.setdefault(float(state["step"]), []).append(p)
            for k, params in by_step.items():
                self._update(group, params, k)

    def _update(self, group: dict, params: list, k: float) -> None:
        lr, gamma, beta2 = group["lr"], group["momentum"], group["beta2"]
        grads = [p.grad for p in params]
        m = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_lerp_(m, grads, 1 - gamma)
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        on_m, on_g = -lr * gamma / (1 - gamma ** (k + 1)), -lr * (1 - gamma) / (1 - gamma ** k)
        if beta2 is None:
            torch._foreach_add_(params, m, alpha=on_m)
            torch._foreach_add_(params, grads, alpha=on_g)
            return
        v = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        denom = torch._foreach_div(v, 1 - beta2 ** k)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(params, m, denom, value=on_m)
        torch._foreach_addcdiv_(params, grads, denom, value=on_g)


def build_async_optimizer(module, cfg) -> torch.optim.Optimizer:
    """The optimizer the runtime steps (cfg: the whole Config): train.optimizer for "stash";
    `DelayedNesterov` over the same parameter groups (weight decay on matrices only) for
    "nesterov"."""
    base = build_optimizer(module, cfg.train)
    if cfg.parallel.async_optimizer == "stash":
        return base
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in base.param_groups]
    beta2 = cfg.train.beta2 if cfg.train.optimizer == "adamw" else None
    return DelayedNesterov(groups, lr=cfg.train.lr, momentum=cfg.parallel.async_momentum, beta2=beta2)
