"""The gradient-communication settings every backend takes: what goes on the wire, in what size.

Two run settings (``--grad-compression``, ``--bucket-mb``) replace the spellings each backend
had of its own (Horovod's compression and fusion threshold, Apex's message size): a backend
maps them onto its engine (DDP's comm hooks and bucket cap, Horovod's compressor and tensor
fusion, DeepSpeed's communication data type and buckets, fully_shard's reduce dtype) or refuses
them, through ``Backend.comm_refusal``, before any process starts. This module has no torch in
it: `mpt launch` parses the settings without importing any backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpt.errors import UsageError
from mpt.parse import one_of, parse_number

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
"""``--grad-compression``: gradients as they are, cast to fp16 or bf16 for the reduction (and
back), or PowerSGD's low-rank approximation with error feedback."""

CASTS = ("fp16", "bf16")
"""The compressions that only change the dtype gradients are reduced in."""

parse_compression = one_of(*COMPRESSIONS)


def parse_bucket_mb(argument: str, value: Any) -> float:
    """``--bucket-mb``: MiB, fractions allowed; 0 is one collective per gradient (no fusion)."""
    number = parse_number(argument, value)
    if not number >= 0:  # NaN too
        raise UsageError(argument, value, "it must be 0 MiB or more",
                         f"pass {argument} 25 (MiB, DDP's default), 0 for one collective per "
                         "gradient, or leave it out for the backend's default")
    return number


@dataclass(frozen=True, kw_only=True, slots=True)
class GradComm:
    """How a backend communicates gradients: the run's ``grad_compression`` and ``bucket_mb``."""

    compression: str = "none"
    """One of ``COMPRESSIONS``."""
    bucket_mb: float | None = None
    """Gradient bytes (MiB, in the gradients' own dtype) reduced in one collective, 0: one per
    gradient; None: the backend's default (DDP 25, Horovod 128, DeepSpeed 5e8 elements, Apex
    1e7 elements)."""

    def __post_init__(self) -> None:
        parse_compression("--grad-compression", self.compression)
        if self.bucket_mb is not None:
            parse_bucket_mb("--bucket-mb", self.bucket_mb)

    @property
    def cast(self) -> str | None:
        """``fp16`` or ``bf16`` where the compression is a cast, else None."""
        return self.compression if self.compression in CASTS else None

    def refused(self, flag: str, reason: str, instead: str) -> tuple[str, Any, str, str]:
        """A refusal of this setting's ``flag`` (``--grad-compression`` or ``--bucket-mb``): the
        flag, its value, why and what works (``Backend.comm_refusal``'s answer)."""
        value = self.compression if flag == "--grad-compression" else self.bucket_mb
        return flag, value, reason, instead
