"""Tensor parallelism: one process per rank, a torch.distributed group, and the model's collectives.

    rank 0      EngineCore (scheduler, sampler, service) + its shard of the model; before every pass it
                broadcasts the pass's inputs (the model runner call) to the other ranks
    rank 1..N-1 its shard of the model only: receives each call, runs the same pass (docs/engine.md)

Collectives run on the device group (NCCL on CUDA, gloo on the CPU); the step messages and start-up
agreements run on a gloo control group.

Reductions (`EngineConfig.tp_reduction`): the partial sums of a row-parallel GEMM must add up in an order
that depends on nothing but the rank count, or the verify pass loses its bit-exactness.

- ``gather_sum``: all-gather the partial sums, then add them on the device in rank order, in float32, and
  round once to the model dtype. Element-wise after the gather, so an element's bits depend only on the
  ranks' partial sums: the same order for every batch, shape and backend. The default.
- ``nccl``: NCCL's own all_reduce with the algorithm and protocol pinned by NCCL_ALGO / NCCL_PROTO (Ring /
  Simple unless set; recorded in the fingerprint). Deterministic for a given message size; at two ranks
  each element is one addition (a + b = b + a), so also batch invariant; past two ranks the ring's chunk
  boundaries, and so the order in which an element's partial sums meet, follow the message size, hence the
  batch: the fixed-shape verify and canonical prefill passes stay deterministic, the fast path does not
  (mode batch_invariant refuses it there). CUDA only.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

REDUCTIONS = ("gather_sum", "nccl")
NCCL_PINS = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
# the control group waits for rank 0's next step message as long as the service idles; a collective of a pass
# (and joining the group) gives up after COLLECTIVE_TIMEOUT
CONTROL_TIMEOUT = datetime.timedelta(days=365)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def pin_nccl_environment() -> dict[str, str]:
    """Set NCCL_ALGO / NCCL_PROTO to Ring / Simple where unset (before any communicator exists, and inherited
    by the worker processes); returns the values in force."""
    for name, value in NCCL_PINS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in NCCL_PINS}


def reduction_id(reduction: str) -> str:
    """The reduction as the runtime fingerprint names it: "gather_sum", or "nccl:<algo>/<proto>" with the
    pinned values in force in this process."""
    if reduction == "gather_sum":
        return reduction
    pins = {name: os.environ.get(name, "unpinned") for name in NCCL_PINS}
    return f"nccl:{pins['NCCL_ALGO']}/{pins['NCCL_PROTO']}"


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group and the model's collectives.

    `device_group` / `control_group` are torch.distributed process groups (None only where nothing is
    communicated: a model built to check its shards)."""

    rank: int
    size: int
    reduction: str = "gather_sum"
    device_group: Any = None
    control_group: Any = None
    workers: list[Any] = field(default_factory=list)  # rank 0: the worker processes it started
    closed: bool = False

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"EngineConfig.tp_reduction: one of {list(REDUCTIONS)}, got {self.reduction!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} outside 0..{self.size - 1}")

    @property
    def driver(self) -> bool:
        return self.rank == 0

    # ---- the model's collectives (every rank, same order) ---------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x [T, H] (partial sums of a row-parallel GEMM), the same bits on every rank."""
        import torch.distributed as dist

        if self.reduction == "nccl":
            dist.all_reduce(x, group=self.device_group)
            return x
        parts = self._gather(x)                                 # [size * T, H], rank r's rows at r * T
        t = x.shape[0]
        acc = parts[:t].float()  # a float32 model sums into the gather buffer itself (a temporary)
        for r in range(1, self.size):
            acc += parts[r * t: (r + 1) * t]
        return acc.to(x.dtype)

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[N, C] per rank (rank r's columns r*C .. r*C + C) -> [N, width], the first `width` of the size*C
        columns (the vocabulary-parallel logits; the last rank's padding columns are dropped)."""
        n, c = x.shape
        parts = self._gather(x)                                 # [size * N, C]
        return parts.view(self.size, n, c).permute(1, 0, 2).reshape(n, self.size * c)[:, :width]

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.device_group)
        return out

    def broadcast_tokens(self, tokens: torch.Tensor | None, count: int, device: torch.device) -> torch.Tensor:
        """Rank 0's Int64[count] device tokens (a decode step's samples) on every rank."""
        import torch.distributed as dist

        buf = tokens.contiguous() if tokens is not None else torch.empty(count, dtype=torch.int64, device=device)
        assert buf.dtype == torch.int64 and buf.numel() == count, (buf.dtype, buf.numel(), count)
        dist.broadcast(buf, src=0, group=self.device_group)
        return buf

    # ---- control: step messages and start-up agreements (gloo) ---------------------------------
    def send(self, message: tuple[Any, ...]) -> None:
        """Rank 0: hand a step message to every worker (after checking that they still run)."""
        import torch.distributed as dist

        if self.closed:
            raise RuntimeError("tensor parallel group closed")
        self._check_workers()
        dist.broadcast_object_list([message], src=0, group=self.control_group)

    def receive(self) -> tuple[Any, ...]:
        """A worker: the next step message from rank 0 (waits as long as the engine idles)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (a KV block budget, a capture that worked: 1 / 0). Rank 0
        stops waiting with a RuntimeError when a worker has exited (it failed to start)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group, async_op=True)
        while self.workers and not work.is_completed():
            self._check_workers()
            time.sleep(0.01)
        work.wait()
        return int(t.item())

    def _check_workers(self) -> None:
        for proc in self.workers:
            if not proc.is_alive():
                raise RuntimeError(f"tensor parallel worker {proc.name} exited with code {proc.exitcode}")

    def close(self) -> None:
        """Rank 0: stop the workers (they finish the message in hand) and leave the group. Idempotent."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        if all(proc.is_alive() for proc in self.workers):
            dist.broadcast_object_list([("stop",)], src=0, group=self.control_group)
        for proc in self.workers:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()


def init_tensor_parallel(rank: int, size: int, reduction: str, device: torch.device, store: Any) -> TensorParallel:
    """Join the group through `store` (rank 0 hosts it) and build both process groups."""
    import torch.distributed as dist

    if device.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rank, size, reduction, device_group=dist.group.WORLD, control_group=control)
