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


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_fused_target_matches_module_forward(preset):
    """The fused verify forward (add+norm, one QKV matmul, q/k-norm + RoPE + store, SiLU·up)
    against the modules' own forward over the same static cache: hidden, taps and the cache."""
    from backends.cuda.fused import FusedTarget
    from backends.cuda.kv import Rows, RowsAttention, StaticKV
    from core.models.loader import random_target

    target = random_target(preset, 0, DEV)
    cfg = target.config
    caches = [StaticKV(cfg.num_layers, 3, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, torch.device(DEV))
              for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    for c in caches[1:]:
        for t in c.k + c.v:
            t.copy_(torch.randn(t.shape, generator=gen))
    for t_src, t_dst in zip(caches[1].k + caches[1].v, caches[0].k + caches[0].v):
        t_dst.copy_(t_src)  # both start from the same cached prefix
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=gen).to(DEV)
    start = torch.tensor([3, 20], device=DEV)
    positions = start[:, None] + torch.arange(5, device=DEV)
    rows = Rows(torch.tensor([2, 0], device=DEV), start)
    with torch.no_grad():
        want, want_taps = target(ids, positions, RowsAttention(caches[0], rows, True), (0, 2))
        got, got_taps = FusedTarget(target)(ids, positions, RowsAttention(caches[1], rows, True), (0, 2))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_taps, want_taps, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
