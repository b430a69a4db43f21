"""server.gpu_memory_utilization: the paged pool's size from the device's memory (memory.py)."""

import functools
import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from draftline.backends.cuda import attention  # noqa: E402
from draftline.backends.cuda.kv import cache_splits  # noqa: E402
from draftline.backends.cuda.memory import (attention_scratch, kv_bytes_per_token, size_pool, weight_bytes,  # noqa: E402
                                            workspace_bytes)
from draftline.core.contract import Capacity  # noqa: E402
from draftline.core.engine import Engine  # noqa: E402
from draftline.core.models.config import ConfigError  # noqa: E402
from draftline.core.models.presets import target_preset  # noqa: E402
from draftline.core.spec import load_spec  # noqa: E402

GIB = 1 << 30


def plan(max_len: int = 256, invariant: bool = False):
    """The attention plan of a cache of ``max_len`` positions and 8 kv heads, for a number of rows."""
    return functools.partial(cache_splits, max_len, invariant, 8)


@pytest.fixture(scope="module")
def dflash():
    return Engine(load_spec("specs/tiny-dflash.yaml"))


def test_a_page_holds_the_targets_and_the_drafters_keys_and_the_cache_takes_none(dflash):
    """A page costs the target's and the drafter's keys alone: cached prefixes live in the pool's
    pages, so prefix caching on leaves the pool as many pages as it off."""
    cfg, drafter = dflash.target.config, dflash.backend.drafter.model
    layers = sum(1 for m in drafter.modules() if hasattr(m, "k_proj"))
    assert layers == len(drafter.layers)
    assert kv_bytes_per_token(drafter, 2) == layers * 2 * drafter.layers[0].self_attn.k_proj.out_features * 2
    cap = Capacity(8, 256, prefix_block=16, kv_page=16, kv_memory=0.5)
    free, total = 30 * GIB, 40 * GIB  # 10 GiB held: the limit of 20 leaves 10 less the workspace
    budget = size_pool(cap, cfg, drafter, 16, [1, 2, 4, 8], torch.bfloat16, (free, total), plan())
    target = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    assert budget.page_bytes == (target + kv_bytes_per_token(drafter, 2)) * 16
    assert budget.workspace == workspace_bytes(cfg, 16, [1, 2, 4, 8], 2, plan())  # no taps passed
    assert budget.pages == (20 * GIB - 10 * GIB - budget.workspace) // budget.page_bytes
    unprefixed = size_pool(Capacity(8, 256, kv_page=16, kv_memory=0.5), cfg, drafter, 16, [1, 2, 4, 8], torch.bfloat16,
                           (free, total), plan())
    assert unprefixed.pages == budget.pages  # prefix caching off: not one page more
    undrafted = size_pool(Capacity(8, 256, kv_page=16, kv_memory=0.5), cfg, None, 16, [1, 2, 4, 8], torch.bfloat16,
                          (free, total), plan())
    assert undrafted.pages > budget.pages  # no drafter keys: more pages in the same bytes


def test_a_share_that_leaves_no_context_is_refused_with_the_fix(dflash):
    cap = Capacity(8, 256, kv_page=16, kv_memory=0.3)
    with pytest.raises(ConfigError, match="gpu_memory_utilization 0.3.*raise server.gpu_memory_utilization"):
        size_pool(cap, dflash.target.config, None, 16, [8], torch.bfloat16, (10 * GIB, 40 * GIB), plan())  # 30 GiB held


def test_the_spec_bounds_the_share():
    data = load_spec("specs/tiny-dflash.yaml").model_dump(mode="python")
    for bad in (0, 1.5):
        data["server"]["gpu_memory_utilization"] = bad
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            type(load_spec("specs/tiny-dflash.yaml")).model_validate(data)


def test_the_workspace_holds_the_widest_rounds_attention_partials(monkeypatch):
    """An 8B-shaped target's verify at 256 rows over a 4,144-key invariant cache launches 17
    splits padded to 32 per (row, kv head), each a 64-row float32 tile: 2 GiB of partials that
    capture allocates, which the workspace must have set aside (an H200 ran out of memory in
    capture at gpu_memory_utilization 0.9 when it had not)."""
    monkeypatch.setattr(attention, "interpreted", lambda: False)  # the device's plan, not the interpreter's
    cfg = target_preset("qwen3-8b")
    invariant = plan(4096 + 48, invariant=True)
    assert invariant(1).count == 17
    scratch = attention_scratch(cfg, [(256, 16)], invariant)
    assert scratch == 256 * cfg.num_kv_heads * 32 * 64 * (cfg.head_dim + 1) * 4
    assert scratch > 2 * GIB
    buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert workspace_bytes(cfg, 16, buckets, 2, invariant) > workspace_bytes(cfg, 16, buckets[:6], 2, invariant) + 2 * GIB
    # the narrower verify widths' graphs keep their logits too: once each (they decide on the device)
    narrow = workspace_bytes(cfg, 16, buckets, 2, invariant, narrow=lambda b: (8, 4, 2) if b >= 4 else ())
    assert narrow - workspace_bytes(cfg, 16, buckets, 2, invariant) >= 4 * cfg.vocab_size * sum(b for b in buckets if b >= 4) * 14
    # a drafter that reads 5 x 4,096 target features a token: each prefill graph keeps them
    taps = workspace_bytes(cfg, 16, buckets, 2, invariant, taps=5 * 4096) - workspace_bytes(cfg, 16, buckets, 2, invariant)
    assert taps >= 5 * GIB  # 146,464 prompt positions over the prefill graphs (measured: 5.59 GiB on an H200)
    # a short cache's plan at one row: the partials of a 256-token prefill's 1,024-row tile
    assert attention_scratch(cfg, [(1, 256)], plan(512)) == 1 * 8 * 4 * 1024 * 129 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["specs/tiny-dflash.yaml", "specs/tiny-none.yaml"])
def test_start_up_reserves_no_more_than_the_workspace_set_aside(path):
    """What an engine's start-up reserves past its weights and its pool (graphs, warm-ups) fits
    the workspace the sizing sets aside for the same configuration: a pool sized from
    gpu_memory_utilization leaves the rest of the device alone. A fixed pool here, so other
    processes on the device do not move the numbers."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    spec = load_spec(path)
    spec = spec.model_copy(update={"backend": "cuda", "server": spec.server.model_copy(
        update={"max_batch_size": 16, "num_kv_blocks": 1024})})
    engine = Engine(spec)
    backend = engine.backend
    drafter = getattr(backend.drafter, "model", None)
    weights = weight_bytes(engine.target, drafter)
    cache = backend.cache
    total = torch.cuda.mem_get_info()[1]
    taps = len(backend.plan.target_layer_ids) * engine.target.config.hidden_size if drafter is not None else 0
    prefix = spec.server.block_size if spec.server.enable_prefix_caching else 0
    capacity = Capacity(16, spec.model.max_model_len, prefix_block=prefix, kv_page=cache.pager.size, kv_memory=1.0)
    budget = size_pool(capacity, engine.target.config, drafter, backend.width, backend.buckets, cache.data.dtype,
                       (total, total), cache.splits, taps, backend.narrow.__getitem__)
    spent = torch.cuda.max_memory_reserved() - base - weights - 1024 * budget.page_bytes
    assert spent <= budget.workspace, (engine.startup, spent, budget.workspace)
