"""The cost model: compute seconds per node (analytic roofline or an ORT profile) and
transfer seconds per copy, on a machine (presets, JSON files, ``ho-onnx calibrate``).

Modules: :mod:`.model` (what the planner asks: :class:`CostModel`), :mod:`.machine`,
:mod:`.analytic`, :mod:`.profiled`, :mod:`.source` (:class:`CostSource` → CostModel).
"""

from .analytic import analytic_costs, node_flops_bytes, node_time
from .machine import MACHINES, Machine, MachineError, load_machine, transfer_time
from .model import CostModel, Direction, NodeCosts, TransferTime, cumulative
from .profiled import profile_costs
from .source import CostSource

__all__ = ["MACHINES", "CostModel", "CostSource", "Direction", "Machine", "MachineError",
           "NodeCosts", "TransferTime", "analytic_costs", "cumulative", "load_machine",
           "node_flops_bytes", "node_time", "profile_costs", "transfer_time"]
