"""How many KV pages fit in the share of the GPU's memory the spec gives the engine
(server.gpu_memory_utilization, vLLM's name).

The pool is sized once the target's and the drafter's weights are on the device: what the
device holds then (this process's and any other's) is spent, a workspace for the largest
forward and the logits the captured graphs keep is set aside, and every page left that fits
takes a page of the target's keys and values at every layer and the drafter's (DFlash's
context, EAGLE-3's layer: they share the target's page table); cached prefixes live in those
pages (prefix.py), so they take none of their own. The workspace is an estimate; start-up measures the peak beside it (``report``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
from torch import nn

from draftline.core.contract import Capacity
from draftline.core.models.config import ConfigError

from .attention import Splits
from .views import PARTIALS_BYTES
from .prefill import PREFILL_GRAPH_TOKENS, PREFILL_WIDTHS

GIB = float(1 << 30)
SEGMENTS = 512 << 20  # the allocator's rounding: each stream's and pool's segments, whatever the model


@dataclass(frozen=True)
class KVBudget:
    """A pool sized from gpu_memory_utilization: its pages and what the sizing assumed (bytes)."""

    pages: int
    page_bytes: int  # a page's target and drafter keys and values
    limit: int  # utilization x the device's memory
    held: int  # in use on the device when the pool was sized (weights, other processes)
    workspace: int  # set aside for activations and the graphs' outputs

    def summary(self) -> dict:
        return {"kv_pages": self.pages, "kv_gib": round(self.pages * self.page_bytes / GIB, 2),
                "limit_gib": round(self.limit / GIB, 2), "held_gib": round(self.held / GIB, 2),
                "workspace_gib": round(self.workspace / GIB, 2)}


def weight_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the modules' parameters, each counted once (a drafter may share the target's)."""
    params = {id(p): p for m in modules if m is not None for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def kv_bytes_per_token(module: nn.Module, itemsize: int) -> int:
    """Keys and values a token costs in the caches of ``module``'s attention layers (each
    module with a k projection keeps one; a query-only layer keeps none)."""
    return sum(2 * m.k_proj.out_features * itemsize for m in module.modules() if isinstance(getattr(m, "k_proj", None),
                                                                                             nn.Linear))


def workspace_bytes(cfg, width: int, buckets: list[int], itemsize: int, splits: Callable[[int], Splits],
                    taps: int = 0, narrow: Callable[[int], tuple[int, ...]] = lambda bucket: ()) -> int:
    """What start-up's graphs and eager prefills reserve beside the weights and the pool, as
    measured on an H200 (bench/memory_probe.py: 8B DFlash at 256 rows, 22.5 GiB in the graphs'
    pool and 3.5 in the eager one, against 26.9 here, 27.4 with SEGMENTS). What the graphs
    keep as outputs: the float32 logits of each prefill graph's rows and of each round graph's
    rows x width, twice at the full width (its graph deciding on the device and the one leaving
    logits to the host) and once at each narrower one a bucket captures (``narrow``), and, for
    a drafter that reads ``taps`` features a token, each prefill graph's tapped features of
    every prompt token. Temporaries twice, once in the graphs' pool and once in the eager
    prefills': the largest prefill's activations (PREFILL_GRAPH_TOKENS tokens through a layer,
    twice over for partial sums) and the largest attention launch's split partials. A tenth
    more, and SEGMENTS, for the allocator's rounding."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = 4 * cfg.hidden_size + qkv + cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size
    activations = 2 * PREFILL_GRAPH_TOKENS * per_token * itemsize
    prefill = [(b, w) for b in buckets for w in PREFILL_WIDTHS if b * w <= PREFILL_GRAPH_TOKENS]
    narrower = [(b, w) for b in buckets for w in narrow(b)]  # decided on the device: one graph each
    rounds = [(b, width) for b in buckets] + narrower
    prefill_rows = sum(2 * b for b, _ in prefill)  # first chunks' graphs and later chunks'
    round_rows = 2 * sum(b * width for b in buckets) + sum(b * w for b, w in narrower)
    logits = 4 * cfg.vocab_size * (prefill_rows + round_rows)
    features = sum(2 * b * w for b, w in prefill) * taps * itemsize
    temporaries = 2 * (activations + attention_scratch(cfg, prefill + rounds, splits))
    return int(1.1 * (logits + features + temporaries)) + SEGMENTS


def attention_scratch(cfg, shapes: list[tuple[int, int]], splits: Callable[[int], Splits]) -> int:
    """Bytes of the split partials (attention.attend's o_part and lse_part, float32) of the
    largest launch among ``shapes`` ((rows, query tokens a row)), under the cache's plan for
    that many rows. A batch-invariant prefill's windows go as rows of launches of at most
    PARTIALS_BYTES (kv.py). Captures free them between graphs: the largest is what counts.
    At a long context a round's are large: the invariant plan's 17 splits of a 4,144-key
    cache pad to 32, 8 MiB a row at Qwen3-8B's shapes (2 GiB at 256 rows)."""
    group, most = cfg.num_heads // cfg.num_kv_heads, 0
    for rows, tokens in shapes:
        plan = splits(rows)
        tile = plan.rows or max(16, triton.next_power_of_2(group * tokens))
        parts = rows * cfg.num_kv_heads * triton.next_power_of_2(plan.count) * tile
        most = max(most, parts * (cfg.head_dim + 1) * 4, PARTIALS_BYTES if plan.rows else 0)
    return most


def size_pool(capacity: Capacity, cfg, drafter: nn.Module | None, width: int, buckets: list[int],
              dtype: torch.dtype, memory: tuple[int, int], splits: Callable[[int], Splits], taps: int = 0,
              narrow: Callable[[int], tuple[int, ...]] = lambda bucket: ()) -> KVBudget:
    """The pages of ``capacity.kv_page`` positions that fit in capacity.kv_memory of a device
    whose ``memory`` is (free, total) bytes now (torch.cuda.mem_get_info, the allocator's
    cached blocks counted free); ``splits`` is the cache's attention plan for a number of rows;
    ``taps``: the target features a token the drafter reads (0: none)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    free, total = memory
    limit, held = int(capacity.kv_memory * total), total - free
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    per_token += 0 if drafter is None else kv_bytes_per_token(drafter, itemsize)
    page = per_token * capacity.kv_page
    workspace = workspace_bytes(cfg, width, buckets, itemsize, splits, taps, narrow)
    pages = (limit - held - workspace) // page
    row = -(-capacity.max_model_len // capacity.kv_page)
    if pages < row:
        raise ConfigError(
            f"server.gpu_memory_utilization {capacity.kv_memory}: {limit / GIB:.1f} GiB of the device's "
            f"{total / GIB:.1f}, of which {held / GIB:.1f} GiB is in use (weights, other processes) and {workspace / GIB:.1f} GiB is "
            f"set aside for activations, leaves room for {max(pages, 0)} KV blocks of {capacity.kv_page} tokens, "
            f"fewer than one {capacity.max_model_len}-token context needs ({row}); raise "
            "server.gpu_memory_utilization, lower model.max_model_len, or set server.num_kv_blocks")
    return KVBudget(int(pages), page, limit, held, workspace)
