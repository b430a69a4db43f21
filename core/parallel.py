"""Tensor parallelism's processes: one per rank on torch.distributed (gloo on CPUs), each
running the same engine over its shard of the target (core/models/shard.py) in lockstep.

Every rank sees the same requests with the same seeds and takes the same decisions, so the
ranks issue the same all-reduces in the same order; rank 0's completions are the result. The
draft policy at more than one rank is fixed (`always`, or a batch limit): `auto` decides from
each rank's own timings, which would part the ranks. A rank that dies ends the run with an error
naming it; the others are stopped, not left waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import random
import socket
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .models.config import ConfigError
from .models.shard import Shard

TIMEOUT_S = 120  # a collective waiting longer than this on a silent rank raises


def current_shard(size: int) -> Shard:
    """This process's Shard in the running group of ``size`` ranks, or a ConfigError naming how
    to start one."""
    if not in_rank():
        raise ConfigError(f"model.tensor_parallel_size {size}: start the engine through draftline.core.parallel "
                          "(parallel.generate, or `draftline generate`), which runs one process per rank")
    if dist.get_world_size() != size:
        raise ConfigError(f"model.tensor_parallel_size {size}, but {dist.get_world_size()} processes run; start "
                          f"{size}")
    return Shard(dist.get_rank(), size)


def in_rank() -> bool:
    """Whether this process is one of a launched group's ranks."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if in_rank() else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        out = fn(*args)
        if rank == 0:
            results.put(("ok", out))
    except Exception as exc:  # noqa: BLE001 (reported to the parent, which names the rank)
        results.put(("error", (rank, exc if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}")))
        raise
    finally:
        dist.destroy_process_group()


def launch(size: int, fn: Callable, *args: Any) -> Any:
    """fn(*args) on ``size`` ranks (module-level fn, picklable args) -> rank 0's return value."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, size, port, fn, args, results), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        return _wait(procs, results)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)


def _wait(procs: list, results: Any) -> Any:
    """Rank 0's result; else the root cause: a rank that died without a word (its peers' errors
    are the broken connections it left), or the first error a rank reported."""
    reported: dict[int, Any] = {}
    deadline = None
    while True:
        try:
            status, value = results.get(timeout=0.2)
        except queue.Empty:
            silent = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]
            if silent:
                rank, code = silent[0]
                raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {code}); the other ranks were "
                                   "stopped") from None
            if reported and (time.monotonic() > deadline or all(p.exitcode is not None for p in procs)):
                rank, error = min(reported.items())
                if isinstance(error, ConfigError):  # the spec's fault, as a one-rank engine reports it
                    raise error
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {error}")
            continue
        if status == "ok":
            return value
        rank, error = value
        reported[rank] = error
        deadline = deadline or time.monotonic() + 5.0  # the others' exits tell a death from an error


def _generate(spec_data: dict, prompts: list, params: list, draft_policy: Any) -> list:
    from .engine import Engine
    from .spec import parse_spec

    engine = Engine(parse_spec(spec_data), draft_policy=draft_policy)
    return engine.generate(prompts, params)


def generate(spec, prompts: Sequence, params, draft_policy: Any = None) -> list:
    """Engine.generate at the spec's model.tensor_parallel_size, one process per rank. Requests
    without a seed get one here, so that every rank samples alike."""
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    params = [p if p.seed is not None else dataclasses.replace(p, seed=random.getrandbits(63)) for p in params]
    policy = draft_policy or spec.speculative.max_draft_batch
    policy = "always" if policy == "auto" else policy  # each rank's own timings would part the ranks
    return launch(spec.model.tensor_parallel_size, _generate, spec.model_dump(mode="json"), list(prompts), params,
                  policy)
