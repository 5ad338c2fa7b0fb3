"""Deciding what leaves the fast tier and when: the decision types, the options, the
eligibility rules, residency and the simulation, and the two deciders (explicit policy,
budget planner) behind one :class:`~ho_onnx.schedule.types.Decider` protocol.

Modules, lower first: :mod:`.types`, :mod:`.options`, :mod:`.eligibility`,
:mod:`.lifetimes`, :mod:`.simulate`, :mod:`.policy`, :mod:`.planner`.
"""

from .options import OffloadOptions
from .planner import BudgetPlanner, InfeasibleBudgetError, Plan, plan
from .policy import ExplicitPolicy, choose
from .simulate import Simulation, simulate
from .types import ActivationOffload, Decider, Decision, OffloadChoice, Tier, WeightOffload

__all__ = ["ActivationOffload", "BudgetPlanner", "Decider", "Decision", "ExplicitPolicy",
           "InfeasibleBudgetError", "OffloadChoice", "OffloadOptions", "Plan", "Simulation",
           "Tier", "WeightOffload", "choose", "plan", "simulate"]
