"""server.gpu_memory_utilization: the paged pool's size from the device's memory (memory.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from draftline.backends.cuda.memory import kv_bytes_per_token, size_pool, workspace_bytes  # noqa: E402
from draftline.core.contract import Capacity  # noqa: E402
from draftline.core.engine import Engine  # noqa: E402
from draftline.core.models.config import ConfigError  # noqa: E402
from draftline.core.spec import load_spec  # noqa: E402

GIB = 1 << 30


@pytest.fixture(scope="module")
def dflash():
    return Engine(load_spec("specs/tiny-dflash.yaml"))


def test_a_page_holds_the_targets_and_the_drafters_keys_and_the_prefix_share(dflash):
    cfg, drafter = dflash.target.config, dflash.backend.drafter.model
    layers = sum(1 for m in drafter.modules() if hasattr(m, "k_proj"))
    assert layers == len(drafter.layers)
    assert kv_bytes_per_token(drafter, 2) == layers * 2 * drafter.layers[0].self_attn.k_proj.out_features * 2
    cap = Capacity(8, 256, prefix_block=16, kv_page=16, kv_memory=0.5)
    free, total = 30 * GIB, 40 * GIB  # 10 GiB held: the limit of 20 leaves 10 less the workspace
    budget = size_pool(cap, cfg, drafter, 16, [1, 2, 4, 8], torch.bfloat16, (free, total))
    target = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    assert budget.page_bytes == int((target + kv_bytes_per_token(drafter, 2)) * 16 * 1.25)
    assert budget.workspace == workspace_bytes(cfg, cap, 16, [1, 2, 4, 8], 2)
    assert budget.pages == (20 * GIB - 10 * GIB - budget.workspace) // budget.page_bytes
    unprefixed = size_pool(Capacity(8, 256, kv_page=16, kv_memory=0.5), cfg, None, 16, [1, 2, 4, 8], torch.bfloat16,
                           (free, total))
    assert unprefixed.pages > budget.pages  # no drafter keys, no prefix share: more pages in the same bytes


def test_a_share_that_leaves_no_context_is_refused_with_the_fix(dflash):
    cap = Capacity(8, 256, kv_page=16, kv_memory=0.3)
    with pytest.raises(ConfigError, match="gpu_memory_utilization 0.3.*raise server.gpu_memory_utilization"):
        size_pool(cap, dflash.target.config, None, 16, [8], torch.bfloat16, (10 * GIB, 40 * GIB))  # 30 GiB held


def test_the_spec_bounds_the_share():
    data = load_spec("specs/tiny-dflash.yaml").model_dump(mode="python")
    for bad in (0, 1.5):
        data["server"]["gpu_memory_utilization"] = bad
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            type(load_spec("specs/tiny-dflash.yaml")).model_validate(data)
