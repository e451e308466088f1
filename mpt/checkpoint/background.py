"""Checkpoints written behind training: at most one at a time, its error raised where it shows.

An asynchronous save does its collectives and copies every tensor to host memory on the training
thread (the only part training waits for), then hands the writing, hashing, fsync, commit and
pruning to this writer's thread. The commit is the same atomic rename as a synchronous save's,
so a process killed mid-write leaves the previous checkpoint as ``latest``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class BackgroundWriter:
    """One thread that writes checkpoints; a new save, a load and the end of the run wait for
    the one in flight and raise what it raised."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._staged: dict[str, torch.Tensor] = {}

    def stage(self, blob: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` in host memory that training cannot change while the thread
        writes them (call it with no write in flight).

        The copies' memory is kept from one save to the next and reused: memory fresh from the
        OS costs a page fault per 4 KiB, which took longer than the copy itself (0.42 s for
        0.45 GiB on the machine of docs/benchmarks.md), so a save then holds the training loop
        for about one memcpy of the state. The price: host memory for one copy of it.
        """
        assert not self.busy, "stage() while a write is in flight"
        staged, on_gpu = {}, False
        for key, tensor in tensors.items():
            on_gpu = on_gpu or tensor.is_cuda
            name = f"{blob}/{key}"
            buffer = self._staged.get(name)
            if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype):
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                     pin_memory=tensor.is_cuda)
                self._staged[name] = buffer
            staged[key] = buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return staged

    @property
    def busy(self) -> bool:
        """Whether a checkpoint is still being written."""
        return self._pending is not None and not self._pending.done()

    def submit(self, write: Callable[[], None]) -> None:
        """Run ``write`` on the writer's thread, after the save before it finished."""
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mpt-checkpoint")
        self._pending = self._pool.submit(write)

    def wait(self) -> None:
        """Block until the checkpoint in flight is committed; raise its error, once."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the checkpoint in flight, then stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
