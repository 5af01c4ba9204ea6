"""The analytic cost model of one training step (docs/planner.md states every formula).

estimate(model, cluster, plan) -> Estimate; step_costs(model, cluster, plan) -> StepCosts,
the per-stage costs the simulator (simulate.py) schedules event by event.
"""

from __future__ import annotations

from loomtrain.planner.plan import Estimate, Plan, StepCosts
from loomtrain.planner.presets import ModelShape
from loomtrain.planner.specs import ClusterSpec


def step_costs(model: ModelShape, cluster: ClusterSpec, plan: Plan) -> StepCosts:
    raise NotImplementedError  # being written


def estimate(model: ModelShape, cluster: ClusterSpec, plan: Plan) -> Estimate:
    raise NotImplementedError  # being written
