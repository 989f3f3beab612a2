"""Execution-plan search for PPO: cost model, simulator, C++ annealing, baselines (see README.md).

Pure: it estimates with the HardwareProfile it is given and never calibrates; a measured profile
(`cpu`) comes from real_py.calibrate.resolve_profile."""

from .costmodel import Mesh, Workload, call_memory, call_time
from .graph import CALLS, PPO_GRAPH, PPOModels, ppo_models
from .hardware import PROFILE_NAMES, PROFILES, HardwareProfile, get_profile
from .problem import Option, Problem
from .realloc_cost import ReallocCost
from .search import SearchResult, estimate, heuristic_baseline, plan_search, symmetric_baseline
from .simulate import Event, SimResult, simulate

__all__ = [
    "Mesh",
    "Workload",
    "call_memory",
    "call_time",
    "CALLS",
    "PPO_GRAPH",
    "PPOModels",
    "ppo_models",
    "PROFILE_NAMES",
    "PROFILES",
    "HardwareProfile",
    "get_profile",
    "Option",
    "Problem",
    "ReallocCost",
    "SearchResult",
    "estimate",
    "heuristic_baseline",
    "plan_search",
    "symmetric_baseline",
    "Event",
    "SimResult",
    "simulate",
]
