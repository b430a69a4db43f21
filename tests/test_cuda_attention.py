"""The static-cache attention kernels against the reference backend's explicit-mask attention.
Without a GPU they run in the Triton interpreter, so CI checks them on the CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from draftline.backends.cuda.attention import CacheAttention, Splits, attend, device_split_plan  # noqa: E402
from draftline.backends.cuda.pages import Pages  # noqa: E402
from draftline.backends.reference.kv import attend as reference_attend  # noqa: E402
from draftline.backends.cuda.ops import CudaOps  # noqa: E402
from draftline.core.models.eager import EAGER  # noqa: E402
from draftline.core.models.ops import Forward  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(slots, hkv, max_len, d, gen):
    k = torch.randn(slots, hkv, max_len, d, generator=gen)
    v = torch.randn(slots, hkv, max_len, d, generator=gen)
    return k.to(DEV), v.to(DEV)


@pytest.mark.parametrize("merge", [False, True])
def test_programs_taking_several_splits_each_give_the_bits_of_one_a_split(merge):
    """Splits.programs: fewer programs per (row, kv head), each taking every so-many of the
    row's live splits, write the same partials and merge them alike (the invariant plan takes
    fewer at many rows)."""
    gen = torch.Generator().manual_seed(3)
    n, hq, hkv, w, d, max_len = 3, 8, 2, 4, 32, 256
    k_cache, v_cache = _cache(6, hkv, max_len, d, gen)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    kv_len = torch.tensor([7, 130, 256], dtype=torch.int32, device=DEV)
    q = torch.randn(n, hq, w, d, generator=gen).to(DEV)
    outs = []
    for programs in (0, 1, 3):
        tickets = torch.zeros(n * hkv, dtype=torch.int32, device=DEV)
        outs.append(attend(q, k_cache, v_cache, slots, kv_len, True, Splits(8, 16, merge=merge, programs=programs),
                           tickets=tickets).cpu())
        assert not tickets.any()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [Splits(4, 16), Splits(8, 64), Splits(2, 128), Splits(4, 16, merge=True),
                                    Splits(2, 128, merge=True)])
def test_cache_attention_matches_reference(causal, splits):
    """Rows of different lengths in shuffled slots, GQA 8:2, splits sized by each row's length
    that cut it mid-way, and programs past a row's last split, merged by a combine kernel or by
    each row's last program: each row equals attention over its own prefix then its new keys.
    Run twice, as a graph replays it: the tickets are back at zero and the output is the same
    to the bit, whichever program merged."""
    gen = torch.Generator().manual_seed(0)
    n, hq, hkv, w, d, max_len = 3, 8, 2, 5, 32, 256
    k_cache, v_cache = _cache(6, hkv, max_len, d, gen)
    before = (k_cache.clone(), v_cache.clone())
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    kv_len = torch.tensor([7, 130, 200], dtype=torch.int32, device=DEV)  # includes the w new tokens
    q = torch.randn(n, hq, w, d, generator=gen).to(DEV)
    k_new = torch.randn(n, w, hkv, d, generator=gen).to(DEV).transpose(1, 2)  # strided, as projections give
    v_new = torch.randn(n, hkv, w, d, generator=gen).to(DEV)
    tickets = torch.zeros(n * hkv, dtype=torch.int32, device=DEV)
    attn = CacheAttention([k_cache], [v_cache], slots, kv_len, causal, splits, tickets)
    out = attn(0, q, k_new, v_new).cpu()
    assert not tickets.any()
    torch.testing.assert_close(attn(0, q, k_new, v_new).cpu(), out, rtol=0, atol=0)
    for i in range(n):
        s, length = int(slots[i]), int(kv_len[i])
        keys = torch.cat([before[0][s, :, : length - w].cpu(), k_new[i].cpu()], dim=1)
        values = torch.cat([before[1][s, :, : length - w].cpu(), v_new[i].cpu()], dim=1)
        torch.testing.assert_close(out[i], reference_attend(q[i].cpu(), keys, values, causal), rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(k_cache[s, :, :length].cpu(), keys)  # the new keys were stored in place
    untouched = [1, 3, 5]
    assert torch.equal(k_cache[untouched].cpu(), before[0][untouched].cpu())


def test_split_plan_spreads_rows_over_the_chip():
    assert device_split_plan(4096) == Splits(16, 128)  # 8 kv heads: 128 programs along one row's keys
    assert device_split_plan(4096, rows=4) == Splits(4, 128, merge=True)  # few splits: the last one merges
    assert device_split_plan(4096, rows=16) == device_split_plan(4096, rows=32) == Splits(2, 128, merge=True)
    assert device_split_plan(4096, kv_heads=2) == Splits(32, 128)  # fewer heads, more splits (64 capped: no split under 128)
    assert device_split_plan(128, rows=1, kv_heads=2) == Splits(4, 32, merge=True)  # a short cache splits in quarters


def test_attention_names_too_few_tickets():
    q = torch.zeros(2, 4, 1, 32, device=DEV)
    cache = torch.zeros(3, 2, 64, 32, device=DEV)
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="tickets for 2 rows x 2 kv heads"):
        attend(q, cache, cache, rows, rows + 1, True, Splits(2, 32, merge=True),
               tickets=torch.zeros(3, dtype=torch.int32, device=DEV))


def _twin_caches(cfg, gen):
    """Two static caches holding the same random prefix."""
    from draftline.backends.cuda.kv import StaticKV

    caches = [StaticKV(cfg.num_layers, 3, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, torch.device(DEV))
              for _ in range(2)]
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    return caches


def _forward(cache, slots: torch.Tensor, start: torch.Tensor, positions: torch.Tensor, causal: bool,
             taps: tuple[int, ...] = ()) -> Forward:
    """A cuda forward over the rows ``slots`` of ``cache``, their new keys after ``start``."""
    from draftline.backends.cuda.views import BLOCK, CAUSAL, KVView

    view = KVView(cache, slots, start + positions.shape[1], CAUSAL if causal else BLOCK)
    return Forward(positions, view, taps)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_fused_stack_matches_module_forward(preset):
    """The target's one forward through the cuda operations (add+norm, one QKV matmul,
    q/k-norm + RoPE + store, SiLU·up) against the eager operations over the same static cache:
    hidden, taps and the stored K/V."""
    from draftline.backends.cuda.linear import fuse
    from draftline.core.models.loader import random_target

    target = random_target(preset, 0, DEV)
    fuse(target)
    gen = torch.Generator().manual_seed(1)
    caches = _twin_caches(target.config, gen)
    ids = torch.randint(0, target.config.vocab_size, (2, 5), generator=gen).to(DEV)
    start = torch.tensor([3, 20], device=DEV)
    positions = start[:, None] + torch.arange(5, device=DEV)
    slots = torch.tensor([2, 0], device=DEV)
    splits = caches[0].splits(len(slots))
    plain = CacheAttention(caches[0].k, caches[0].v, slots, start + 5, True, splits)  # eager: stores, then attends
    with torch.no_grad():
        want, want_taps = target.run(EAGER, Forward(positions, plain, (0, 2)), ids)
        got, got_taps = target.run(CudaOps(), _forward(caches[1], slots, start, positions, True, (0, 2)), ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_taps, want_taps, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_stack_runs_the_dflash_block():
    """The DFlash drafter's non-causal block forward through the cuda operations, against the
    eager ones."""
    from draftline.backends.cuda.linear import fuse
    from draftline.core.models.loader import random_dflash

    drafter = random_dflash("tiny-dflash", 1, DEV)
    fuse(drafter)
    gen = torch.Generator().manual_seed(2)
    caches = _twin_caches(drafter.config.layers, gen)
    embeds = torch.randn(2, 6, drafter.config.layers.hidden_size, generator=gen).to(DEV)
    start = torch.tensor([7, 30], device=DEV)
    positions = start[:, None] + torch.arange(6, device=DEV)
    slots = torch.tensor([1, 2], device=DEV)
    plain = CacheAttention(caches[0].k, caches[0].v, slots, start + 6, False, caches[0].splits(len(slots)))
    with torch.no_grad():
        want = drafter.run(EAGER, Forward(positions, plain), embeds)
        got = drafter.run(CudaOps(), _forward(caches[1], slots, start, positions, False), embeds)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_projected_context_matches_the_drafters_own():
    """The DFlash drafter's context K/V written through the cuda operations (fc, the hidden
    norm, then one matvec and one k-norm/RoPE/store kernel a layer), as the engine runs it,
    equals the eager operations' context_kv, stored row by row."""
    from draftline.backends.cuda.kv import Rows, StaticStore
    from draftline.backends.cuda.linear import fuse
    from draftline.core.models.loader import random_dflash

    drafter = random_dflash("tiny-dflash", 1, DEV)
    fuse(drafter)
    cfg = drafter.config
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(2, 4, len(cfg.target_layer_ids) * cfg.layers.hidden_size, generator=gen).to(DEV)
    start = torch.tensor([5, 12], device=DEV)
    positions = start[:, None] + torch.arange(4, device=DEV)
    store = StaticStore(3, 64, torch.device(DEV), CudaOps())
    store.allocate(drafter)
    slots = torch.tensor([2, 0], device=DEV)
    with torch.no_grad():
        drafter.store_context(store.ops, store.forward(Rows(slots), positions, causal=False), features)
        want = drafter.context_kv(features, positions)
    for layer, (k, v) in enumerate(want):
        for row, (slot, first) in enumerate(zip(slots.tolist(), start.tolist())):
            got_k = store.cache.k[layer][slot, :, first : first + 4]
            got_v = store.cache.v[layer][slot, :, first : first + 4]
            torch.testing.assert_close(got_k, k[row], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_v, v[row], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_bf16_merge_of_bf16_partials_stays_close():
    """bf16 caches: a merge by the last split reads partials stored in bf16, the combine kernel
    float32 ones; both stay within bf16 rounding of float32 attention over the same values."""
    gen = torch.Generator().manual_seed(4)
    n, hq, hkv, w, d, max_len = 4, 32, 8, 16, 128, 1024
    k_cache, v_cache = (c.bfloat16() for c in _cache(5, hkv, max_len, d, gen))
    slots = torch.tensor([3, 0, 1, 4], dtype=torch.int32, device=DEV)
    kv_len = torch.tensor([40, 528, 1000, 300], dtype=torch.int32, device=DEV)
    q = torch.randn(n, hq, w, d, generator=gen).to(DEV).bfloat16()
    tickets = torch.zeros(n * hkv, dtype=torch.int32, device=DEV)
    outs = [attend(q, k_cache, v_cache, slots, kv_len, True, Splits(4, 128, merge=merge), tickets=tickets).float()
            for merge in (True, False)]
    for i in range(n):
        s, length = int(slots[i]), int(kv_len[i])
        want = reference_attend(q[i].float().cpu(), k_cache[s, :, :length].float().cpu(),
                                v_cache[s, :, :length].float().cpu(), True)
        for out in outs:
            assert float((out[i].cpu() - want).norm() / want.norm()) < 1e-2


def _in_pages(cache, size, gen):
    """A static cache [slots, Hkv, L, D] scattered over a pool of ``size``-position pages in a
    shuffled order, with pages no row owns among them -> (pool [pages, Hkv, size, D], Pages)."""
    slots, hkv, max_len, d = cache.shape
    per_row = max_len // size
    order = torch.randperm(slots * per_row + 5, generator=gen)[: slots * per_row]
    pool = torch.randn(slots * per_row + 5, hkv, size, d, generator=gen).to(cache.device)  # unowned: noise
    pool[order.to(cache.device)] = cache.view(slots, hkv, per_row, size, d).transpose(1, 2).reshape(-1, hkv, size, d)
    return pool, Pages(order.view(slots, per_row).to(torch.int32).to(cache.device), size)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [Splits(4, 16), Splits(2, 128, merge=True)])
def test_keys_read_and_stored_through_pages_as_in_a_static_cache(causal, splits):
    """Paged KV: the same rows over the same keys, held in 16-position pages scattered through a
    pool (pages.py), store their new keys at the same positions and attend to the bit as over
    the static cache; the sliding-window kernel reads through the pages alike."""
    from draftline.backends.cuda.sliding import ANCHOR_OWN, Window, attend_window

    gen = torch.Generator().manual_seed(3)
    n, hq, hkv, w, d, max_len = 3, 8, 2, 5, 32, 256
    k_cache, v_cache = _cache(6, hkv, max_len, d, gen)
    k_pool, pages = _in_pages(k_cache, 16, torch.Generator().manual_seed(9))
    v_pool, _ = _in_pages(v_cache, 16, torch.Generator().manual_seed(9))  # the same order
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    kv_len = torch.tensor([7, 130, 200], dtype=torch.int32, device=DEV)
    q = torch.randn(n, hq, w, d, generator=gen).to(DEV)
    k_new = torch.randn(n, hkv, w, d, generator=gen).to(DEV)
    v_new = torch.randn(n, hkv, w, d, generator=gen).to(DEV)
    static = CacheAttention([k_cache], [v_cache], slots, kv_len, causal, splits)(0, q, k_new, v_new)
    paged = CacheAttention([k_pool], [v_pool], slots, kv_len, causal, splits, pages=pages)(0, q, k_new, v_new)
    assert torch.equal(paged, static)
    table = pages.table.long()
    for i in range(n):  # the new keys landed in the rows' own pages, at their positions
        s, length = int(slots[i]), int(kv_len[i])
        gathered = k_pool[table[s]].transpose(0, 1).reshape(hkv, max_len, d)
        assert torch.equal(gathered[:, :length], k_cache[s, :, :length])
    window = Window(40, causal, ANCHOR_OWN)
    assert torch.equal(attend_window(q, k_pool, v_pool, slots, kv_len, window, pages=pages),
                       attend_window(q, k_cache, v_cache, slots, kv_len, window))


def test_a_fused_layer_stores_and_attends_through_pages():
    """A decoder layer through the cuda operations (the q/k/v kernel's q/k-norm, RoPE and K/V store, then
    the decode kernel) over a cache held in scattered 16-position pages gives the static
    cache's output to the bit and stores its new keys and values at the same positions."""
    from draftline.backends.cuda.kv import StaticKV
    from draftline.core.models.layers import DecoderLayer, Rotary
    from draftline.core.models.presets import target_preset

    torch.manual_seed(0)
    cfg = target_preset("tiny-qwen3")
    layer, rotary = DecoderLayer(cfg).to(DEV), Rotary(cfg.rope, cfg.head_dim).to(DEV)
    hkv, d, max_len, n, w = cfg.num_kv_heads, cfg.head_dim, 64, 3, 4
    static = StaticKV(1, 4, hkv, max_len, d, torch.float32, torch.device(DEV))
    static.data.normal_()
    paged = StaticKV(1, 4, hkv, max_len, d, torch.float32, torch.device(DEV))
    gen = torch.Generator().manual_seed(5)
    k_pool, paged.pages = _in_pages(static.k[0].clone(), 16, gen)
    v_pool, _ = _in_pages(static.v[0].clone(), 16, torch.Generator().manual_seed(5))
    paged.k, paged.v = [k_pool], [v_pool]
    slots = torch.tensor([3, 0, 1], dtype=torch.int32, device=DEV)
    kv_len = torch.tensor([9, 40, 64], dtype=torch.int32, device=DEV)
    positions = (kv_len[:, None] - w + torch.arange(w, device=DEV)[None, :]).long()
    h, x = torch.randn(n, w, cfg.hidden_size, device=DEV), torch.randn(n, w, cfg.hidden_size, device=DEV)
    want = _layer(layer, h, x, positions, rotary, static, slots, kv_len)
    got = _layer(layer, h, x, positions, rotary, paged, slots, kv_len)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    table = paged.pages.table.long()
    for cache, pool in ((static.k[0], k_pool), (static.v[0], v_pool)):
        gathered = pool[table].permute(0, 2, 1, 3, 4).reshape(cache.shape)
        assert torch.equal(gathered, cache)  # every slot's positions, the new ones too


@pytest.mark.gpu
def test_the_qkv_kernel_writes_the_same_bits_with_any_warps(monkeypatch):
    """qkv.QKV_WARPS only spreads a (token, head) row's tile over fewer threads: with 1, 2 or
    4 warps a bf16 layer writes the same q, keys and values, so the output keeps its bits."""
    from draftline.backends.cuda import qkv
    from draftline.backends.cuda.kv import StaticKV
    from draftline.core.models.layers import DecoderLayer, Rotary
    from draftline.core.models.presets import target_preset

    torch.manual_seed(0)
    cfg = target_preset("tiny-qwen3")
    layer = DecoderLayer(cfg).to(DEV, torch.bfloat16)
    rotary = Rotary(cfg.rope, cfg.head_dim).to(DEV)
    n, w = 16, 16  # a 16-row verify: 256 tokens
    slots = torch.arange(n, dtype=torch.int32, device=DEV)
    kv_len = torch.randint(w, 64, (n,), dtype=torch.int32, device=DEV)
    positions = (kv_len[:, None] - w + torch.arange(w, device=DEV)[None, :]).long()
    h = torch.randn(n, w, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(n, w, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    results = []
    for warps in (4, 2, 1):
        monkeypatch.setattr(qkv, "QKV_WARPS", warps)
        cache = StaticKV(1, n, cfg.num_kv_heads, 64, cfg.head_dim, torch.bfloat16, torch.device(DEV))
        out = _layer(layer, h, x, positions, rotary, cache, slots, kv_len)
        results.append((out, cache.k[0].clone(), cache.v[0].clone()))
    for out, k, v in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, results[0][0]))
        assert torch.equal(k, results[0][1]) and torch.equal(v, results[0][2])


@pytest.mark.parametrize("head_dim", [32, 128])
def test_a_tokens_q_k_and_v_bits_do_not_depend_on_the_batch(head_dim):
    """The q/k/v kernel's GPU tile holds heads_per_program heads, a choice of the model's shape
    alone (4 for D 32, 2 for D 128): a row's q, keys and values are the same bits in a 512-token
    verify as in a 16-token one (interpreter: every tile holds whole tokens alike)."""
    from dataclasses import replace

    from draftline.backends.cuda import qkv as kernel
    from draftline.backends.cuda.kv import StaticKV
    from draftline.backends.cuda.linear import fuse
    from draftline.core.models.layers import DecoderLayer, Rotary
    from draftline.core.models.presets import target_preset

    torch.manual_seed(0)
    cfg = replace(target_preset("tiny-qwen3"), head_dim=head_dim)
    layer = DecoderLayer(cfg).to(DEV, torch.bfloat16)
    fuse(layer)
    rotary = Rotary(cfg.rope, cfg.head_dim).to(DEV)
    heads = cfg.num_heads + 2 * cfg.num_kv_heads
    assert kernel.heads_per_program(heads, head_dim) == {32: 4, 128: 2}[head_dim]
    n, w = 32, 16
    kv_len = torch.randint(w, 64, (n,), dtype=torch.int32, device=DEV)
    positions = (kv_len[:, None] - w + torch.arange(w, device=DEV)[None, :]).long()
    qkv = torch.randn(n * w, heads * head_dim, device=DEV, dtype=torch.bfloat16)

    def run(rows):
        cache = StaticKV(1, n, cfg.num_kv_heads, 64, head_dim, torch.bfloat16, torch.device(DEV))
        cache.k[0].zero_(), cache.v[0].zero_()
        slots = torch.tensor(rows, dtype=torch.int32, device=DEV)
        picked = qkv.view(n, w, -1)[rows].reshape(len(rows) * w, -1)
        q = kernel.project_heads(layer.self_attn, picked, positions[rows], rotary, cache, 0, slots, kv_len[rows])
        return q.transpose(1, 2), cache.k[0][rows], cache.v[0][rows]  # q [rows, W, Hq, D]

    whole = run(list(range(n)))
    alone = run([5])
    assert all(torch.equal(a[0].view(torch.int16), b[5].view(torch.int16)) for a, b in zip(alone, whole))


def _layer(layer, h, x, positions, rotary, cache, slots, kv_len):
    """One decoder layer through the cuda operations, its keys into layer 0 of ``cache``."""
    from draftline.backends.cuda.linear import fuse
    from draftline.backends.cuda.views import CAUSAL, KVView
    from draftline.core.models.layers import decoder_layer

    fuse(layer)
    fwd = Forward(positions, KVView(cache, slots, kv_len, CAUSAL))
    return decoder_layer(CudaOps(), fwd, 0, layer, rotary, h, x)


def test_page_table_never_gives_a_page_twice():
    """Random reserves and releases over a small pool: every page is free or held by exactly
    one slot, a slot's table line is its pages in order then the scratch page, and a reserve
    the pool cannot meet is refused with a message, changing nothing."""
    import random

    from draftline.backends.cuda.pages import PagesExhausted, PageTable

    pool = PageTable(num_slots=5, per_row=6, num_pages=12, size=4, device=torch.device(DEV))
    rng = random.Random(1)
    for _ in range(400):
        slot = rng.randrange(5)
        if rng.random() < 0.3:
            pool.release(slot)
        else:
            try:
                pool.reserve(slot, rng.randrange(0, 30))
            except PagesExhausted as err:
                assert "server.num_kv_blocks" in str(err)
        pool.flush()
        held = [p for line in pool.owned for p in line]
        assert sorted(held + pool.free) == list(range(12)) and len(set(held)) == len(held)
        for s, line in enumerate(pool.owned):
            assert pool.pages.table[s].tolist() == line + [pool.scratch] * (6 - len(line))
