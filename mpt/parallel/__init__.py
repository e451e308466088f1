"""The job's parallel layout (``ParallelPlan``): every axis, its rank arithmetic and mesh."""

from mpt.parallel.plan import AXES, Axis, ParallelPlan, Topology, divisors

__all__ = ["AXES", "Axis", "ParallelPlan", "Topology", "divisors"]
