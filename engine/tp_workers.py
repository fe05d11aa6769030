"""Tensor-parallel processes: rank 0 drives, ranks 1..N-1 run the model only (docs/engine.md).

    rank 0 (the engine's process)              rank r (a spawned worker, device cuda:r or the CPU)
    start_workers(config) -> TensorParallel    worker_main: join the group, load the shard, build the runner
    DriverRunner.prefill / decode / verify:    serve(): receive the call, run the same pass
      1. send the call (rows, pass shape)        (its logits are not read: only rank 0 samples)
      2. broadcast the chained input tokens
         (overlap: the previous step's samples, on the device)
      3. run the pass; its collectives meet the workers'

Every rank holds its shard of the weights and of the KV cache (its KV heads, the same blocks), and runs the
same passes with the same shapes, so their collectives pair up in order. Rank 0 alone schedules, samples,
commits and serves; a worker holds no request state.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from engine.config import EngineConfig, TpReduction
from engine.model_runner import Chain, ModelRunner, Row, load_shard
from engine.parallel import TensorParallel, init_tensor_parallel, pin_nccl_environment
from engine.sequence import PromptLogprobs

log = logging.getLogger("engine.tp")

ChainSpec = tuple["int | None", list[int], list[int]]
"""A chain as a step message carries it: (token count, or None when it has no device tokens; dst; src)."""


def start_workers(config: EngineConfig) -> TensorParallel:
    """Rank 0: spawn ranks 1..N-1, join the group with them; the returned group holds the processes."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from engine.parallel import COLLECTIVE_TIMEOUT

    size, device = config.tensor_parallel_size, config.torch_device
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine (or another torch.distributed group) already runs in this "
                           "process; there can be one per process: close it first (LLM.close)")
    if device.type == "cuda":
        if torch.cuda.device_count() < size:
            raise ValueError(f"EngineConfig.tensor_parallel_size: {size} ranks need {size} CUDA devices, this "
                             f"machine has {torch.cuda.device_count()}")
        torch.cuda.set_device(0)
    if config.tp_reduction == TpReduction.NCCL:
        pin_nccl_environment()  # before any communicator, and inherited by the workers
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=worker_main, args=(config, rank, store.port, os.getpid()),
                           name=f"verbatim-tp-rank{rank}", daemon=True) for rank in range(1, size)]
    for proc in workers:
        proc.start()
    try:
        tp = init_tensor_parallel(0, size, config.tp_reduction.value, device, store)
    except BaseException:
        for proc in workers:
            proc.terminate()
        raise
    tp.workers = workers
    return tp


def worker_main(config: EngineConfig, rank: int, port: int, parent_pid: int) -> None:
    """A worker rank's process: its shard and runner, then rank 0's passes until told to stop."""
    import torch.distributed as dist

    from engine.parallel import COLLECTIVE_TIMEOUT

    _exit_with_parent(parent_pid)
    if config.torch_device.type == "cuda":
        torch.cuda.set_device(rank)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    tp = init_tensor_parallel(rank, config.tensor_parallel_size, config.tp_reduction.value, config.torch_device,
                              store)
    loaded = load_shard(config, tp)
    runner = ModelRunner(config, loaded.model, loaded.shape, config.torch_dtype, config.torch_device, tp)
    serve(runner, tp)
    dist.destroy_process_group()


def serve(runner: ModelRunner, tp: TensorParallel) -> None:
    """Run rank 0's passes until ("stop",). A pass that raises (as it then does on rank 0, before any
    collective: a bad row layout) is logged and the next one is awaited."""
    while True:
        kind, *args = tp.receive()
        if kind == "stop":
            return
        try:
            if kind == "prefill":
                rows, pass_tokens, prompt_logprobs = args
                runner.prefill_with_prompts(rows, pass_tokens, prompt_logprobs)
            elif kind == "decode":
                rows, spec = args
                runner.decode(rows, chain=_receive_chain(tp, spec, runner.device))
            elif kind == "verify":
                rows, carried, spec, row_chain = args
                runner.verify(rows, carried, chain=_receive_chain(tp, spec, runner.device), row_chain=row_chain)
            else:
                raise ValueError(f"unknown step message {kind!r}")
        except (ValueError, AssertionError) as exc:
            log.error("tensor parallel rank %d: %s pass failed: %r", tp.rank, kind, exc)


class DriverRunner(ModelRunner):
    """Rank 0's model runner: every pass is first sent to the workers, which run it alongside."""

    tp: TensorParallel

    def prefill_with_prompts(self, rows: list[Row], pass_tokens: int | None, prompt_logprobs: dict[int, int]
                             ) -> tuple[torch.Tensor, dict[int, PromptLogprobs]]:
        self.tp.send(("prefill", rows, pass_tokens, prompt_logprobs))
        return super().prefill_with_prompts(rows, pass_tokens, prompt_logprobs)

    def decode(self, rows: list[Row], chain: Chain | None = None) -> torch.Tensor:
        self.tp.send(("decode", rows, _chain_spec(chain)))
        _send_chain(self.tp, chain, self.device)
        return super().decode(rows, chain)

    def verify(self, rows: list[Row], carried: list[Row] | None = None, chain: Chain | None = None,
               row_chain: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        self.tp.send(("verify", rows, carried, _chain_spec(chain), row_chain))
        _send_chain(self.tp, chain, self.device)
        return super().verify(rows, carried, chain, row_chain)

    def close(self) -> None:
        self.tp.close()


def _chain_spec(chain: Chain | None) -> ChainSpec | None:
    if chain is None:
        return None
    tokens, dst, src = chain
    return (None if tokens is None else tokens.numel()), list(dst), list(src)


def _send_chain(tp: TensorParallel, chain: Chain | None, device: torch.device) -> None:
    if chain is not None and chain[0] is not None:
        tp.broadcast_tokens(chain[0], chain[0].numel(), device)


def _receive_chain(tp: TensorParallel, spec: ChainSpec | None, device: torch.device) -> Chain | None:
    if spec is None:
        return None
    count, dst, src = spec
    tokens = None if count is None else tp.broadcast_tokens(None, count, device)
    return tokens, dst, src


def _exit_with_parent(parent_pid: int) -> None:
    """A worker ends when rank 0's process is gone (killed without a chance to stop it)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="verbatim-tp-parent-watch", daemon=True).start()
