"""The planner as a component: parallel.plan = "auto" (planner/apply.py)."""

from __future__ import annotations

from typing import Literal

from loomtrain.component import Component, Refusal, Section, Switch

_COVERS = ("the planner's cost model covers backprop on the GPT and the llama over dp, tp, pp, "
           "cp and ZeRO")


class PlanKeys(Section):
    # "auto": before training, the planner (loomtrain.planner) searches the plans of this
    # model on nproc ranks at train.global_batch and runs the best; its dp, tp, pp, cp, ep, ZeRO,
    # schedule, micro-batch, recompute and offload settings replace those given here
    # (train.precision is kept: planner/apply.py choose_here, resolve_auto), and the written
    # config.toml holds them, with "none"
    plan: Literal["none", "auto"] = "none"


class Plan(Component):
    name = "plan"
    section, keys = "parallel", PlanKeys
    switches = (Switch("parallel.plan", "none"),)
    summary = "the layout chosen by the cost model before training"
    refuses = {"zeroth": Refusal(_COVERS), "asyncsgd": Refusal(_COVERS),
               "lowcomm": Refusal(_COVERS)}

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.parallel.plan != "none" and cfg.model.name not in ("gpt", "llama"):
            raise ValueError(f'parallel.plan="auto" with model.name={cfg.model.name!r} is not '
                             f'supported: {_COVERS} (model.name="gpt" or "llama")')
