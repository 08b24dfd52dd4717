"""The ranks of a job started by ``torchrun`` or ``accelerate launch``, through ``torch.distributed``.

Both launchers start one process per GPU (or per CPU share), on one machine or several, and tell
each process who it is in the same environment variables (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``), so kvcli reads those instead of depending on either launcher.
Gloo carries the ranks' messages on the CPU and NCCL on GPUs; kvcli only ever gathers Python
objects (finished rows) on rank 0 and waits at barriers, so either backend does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvcli.errors import KvcliError


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: rank ``rank`` of ``world_size`` (rank 0 of 1 when run alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        """Rank 0 merges and prints; the other ranks only compute."""
        return self.rank == 0

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0, in rank order; None on the other ranks."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.main else None
        dist.gather_object(value, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def launched_ranks() -> int:
    """How many ranks the launcher started (1 when kvcli runs on its own)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        raise KvcliError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of processes") from None


def join(device: str) -> tuple[Ranks, str]:
    """Join the job the launcher started (nothing to join when run alone) and pick this rank's device.

    On CUDA, ``auto`` and ``cuda`` become ``cuda:LOCAL_RANK`` (one GPU per process) and NCCL carries
    the messages; on the CPU, gloo, and each process takes its share of the cores unless
    ``OMP_NUM_THREADS`` says otherwise (torchrun sets it to 1), so ranks do not fight over cores.
    """
    world = launched_ranks()
    if world == 1:
        return Ranks(), device
    import torch
    import torch.distributed as dist

    try:
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        raise KvcliError("WORLD_SIZE is set but RANK is not: start several processes with torchrun or "
                         "accelerate launch") from None
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        if device in ("auto", "cuda"):
            device = f"cuda:{local}"
        if not torch.cuda.is_available():
            raise KvcliError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
        torch.cuda.set_device(torch.device(device))
    elif "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if cuda else "gloo")
        except (RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise KvcliError(f"cannot join the distributed job as rank {rank} of {world}: {first}") from None
    return Ranks(rank, world, local), device
