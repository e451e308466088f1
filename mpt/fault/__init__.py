"""Fault tolerance inside the workers: preemption that ends at a step every rank agrees on, and
the heartbeat the launcher reads to name a rank that stopped progressing."""

from mpt.fault.heartbeat import Beat, Heartbeat, StallWatch, read_beats, suspects
from mpt.fault.preemption import REQUEUE_EXIT_CODE, Preemption

__all__ = ["REQUEUE_EXIT_CODE", "Beat", "Heartbeat", "Preemption", "StallWatch", "read_beats",
           "suspects"]
