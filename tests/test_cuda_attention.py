"""The static-cache attention kernels against the reference backend's explicit-mask attention.
Without a GPU they run in the Triton interpreter, so CI checks them on the CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from backends.cuda.attention import CacheAttention, split_size  # noqa: E402
from backends.reference.kv import attend as reference_attend  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(slots, hkv, max_len, d, gen):
    k = torch.randn(slots, hkv, max_len, d, generator=gen)
    v = torch.randn(slots, hkv, max_len, d, generator=gen)
    return k.to(DEV), v.to(DEV)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split", [64, 128])
def test_cache_attention_matches_reference(causal, split):
    """Rows of different lengths in shuffled slots, GQA 4:2, splits that cut rows mid-way and
    splits that see no key: each row equals attention over its own prefix then its new keys."""
    gen = torch.Generator().manual_seed(0)
    n, hq, hkv, w, d, max_len = 3, 4, 2, 5, 32, 256
    k_cache, v_cache = _cache(6, hkv, max_len, d, gen)
    before = (k_cache.clone(), v_cache.clone())
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    kv_len = torch.tensor([7, 130, 200], dtype=torch.int32, device=DEV)  # includes the w new tokens
    q = torch.randn(n, hq, w, d, generator=gen).to(DEV)
    k_new = torch.randn(n, w, hkv, d, generator=gen).to(DEV).transpose(1, 2)  # strided, as projections give
    v_new = torch.randn(n, hkv, w, d, generator=gen).to(DEV)
    attn = CacheAttention([k_cache], [v_cache], slots, kv_len, causal, split)
    out = attn(0, q, k_new, v_new).cpu()
    for i in range(n):
        s, length = int(slots[i]), int(kv_len[i])
        keys = torch.cat([before[0][s, :, : length - w].cpu(), k_new[i].cpu()], dim=1)
        values = torch.cat([before[1][s, :, : length - w].cpu(), v_new[i].cpu()], dim=1)
        torch.testing.assert_close(out[i], reference_attend(q[i].cpu(), keys, values, causal), rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(k_cache[s, :, :length].cpu(), keys)  # the new keys were stored in place
    untouched = [1, 3, 5]
    assert torch.equal(k_cache[untouched].cpu(), before[0][untouched].cpu())


def test_split_size_spreads_long_rows():
    assert split_size(256) == 64 and split_size(4096) == 256 and split_size(40960) == 4096
