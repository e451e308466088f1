"""ZeRO-3's fp32 master partitions, shared with the weights' partitions where DeepSpeed meant to.

DeepSpeed's stage 3 (``runtime/zero/stage3.py``, ``_create_fp32_partitions``) skips the fp32
master copy of a partition that is already fp32 on the optimizer's device, making the master an
alias of it. Its test compares the partition's ``torch.device`` with ``self.device``, a string
(``get_accelerator().current_device_name()``); a ``torch.device`` never equals a string, so the
copy is always made: a second fp32 copy of every partition for the whole run (measured in
docs/benchmarks.md: ZeRO-3's peak at 0.77-0.92 x the full state where fsdp reaches 0.61 x).

``share_fp32_partitions`` makes the test hold after the fact: where the partition's dtype and
device are the master's and only the device's spelling differed, the master takes the
partition's storage (as DeepSpeed's own alias branch would have), and the copy is freed. Nothing
else changes: DeepSpeed's step writes the master back into the partition with ``copy_``, which is
then a copy onto itself. Where DeepSpeed already aliased (its comparison fixed), there is
nothing to do, and ``share_fp32_partitions`` says so by returning 0.
"""

from __future__ import annotations

from typing import Any

import torch


def share_fp32_partitions(optimizer: Any) -> int:
    """Alias each redundant fp32 master partition of a ZeRO-3 ``optimizer`` to its weights'
    partition; return the bytes freed (0 when DeepSpeed made none, or kept them on purpose:
    offloaded or swapped optimizer state, a master dtype other than the weights')."""
    if getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "swap_optimizer",
                                                                 False):
        return 0  # the masters live elsewhere on purpose
    device = torch.device(optimizer.device)  # the string the faulty comparison was given
    freed = 0
    pairs = zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat,
                strict=True)
    for weights, master in pairs:
        if (weights is None or master is weights or weights.dtype != master.dtype
                or weights.device != device or master.device != device
                or master.untyped_storage().data_ptr() == weights.untyped_storage().data_ptr()):
            continue
        weights.data.copy_(master.data)  # the master is the truth: its values stay
        freed += master.numel() * master.element_size()
        master.data = weights.data
    return freed
