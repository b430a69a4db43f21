"""model.batch_invariant: a target row's results do not depend on the rows beside it. For each
kernel of the target's step, and for the whole step, a row computed inside windows and batches
is bit-equal to the same row alone (and a verify window to the decode steps it replaces).
Without a GPU the kernels run in the Triton interpreter (float32); on the GPU in bfloat16 with
the device's split plan."""

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
triton = pytest.importorskip("triton")

from draftline.backends.cuda.attention import attend, invariant_split_plan  # noqa: E402
from draftline.backends.cuda.matvec import invariant_tiling, matvec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32


GPU_ONLY = pytest.mark.skipif(DEV != "cuda", reason="an LM head's width: minutes under the interpreter")


@pytest.mark.parametrize("n,k,gated", [(96, 256, False), (32, 1024, False), (48, 256, True),
                                       pytest.param(65536, 256, False, marks=GPU_ONLY),
                                       pytest.param(2048, 2048, True, marks=GPU_ONLY),
                                       pytest.param(4096, 4096, False, marks=GPU_ONLY)])
def test_a_matvec_row_is_the_same_alone_and_in_any_batch(n, k, gated):
    """(32, 1024): K split into partial sums; the gated form; batches past one row tile, and
    from matvec.WIDE_ROWS rows the wider program shapes (an LM head's, the MLP's: weights of
    matvec.WIDE_WEIGHTS elements and more)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, k, generator=gen).to(DEV, DTYPE)
    w = (torch.randn(2 * n if gated else n, k, generator=gen) / k**0.5).to(DEV, DTYPE)
    tiling = invariant_tiling(n, k, gated)
    alone = [matvec(x[r : r + 1], w, tiling, gated, invariant=True) for r in (0, 2, 70, 255)]
    for m in (3, 8, 16, 80, 256) + ((128, 200) if DEV == "cuda" else ()):  # both wide shapes on the GPU
        batch = matvec(x[:m], w, tiling, gated, invariant=True)  # [M, N], or partials [split, M, N]
        for r, want in zip((0, 2, 70, 255), alone):
            if r < m:
                assert torch.equal(batch[..., r : r + 1, :], want), (m, r)


@pytest.mark.parametrize("max_len", [200, 1100, 4200])  # on the GPU: 1 split; 5 merged in place; 17 and a combine
@pytest.mark.parametrize("programs", [0, 1, 3])  # 0: as many as the plan takes for the rows (INVARIANT_PROGRAMS)
def test_a_query_attends_alike_alone_in_a_window_and_beside_other_rows(max_len, programs):
    if programs and DEV == "cpu":
        pytest.skip("the interpreter's plan is one split: its programs change nothing there (the GPU runs these)")
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d = 8, 2, 32
    k = torch.randn(9, hkv, max_len, d, generator=gen).to(DEV, DTYPE)
    v = torch.randn(9, hkv, max_len, d, generator=gen).to(DEV, DTYPE)
    q_star = torch.randn(hq, d, generator=gen).to(DEV, DTYPE)
    pos, slot = max_len // 2 + 17, 4  # the query's position (as many keys before it) and cache slot

    def run(width: int, t: int, others: int) -> torch.Tensor:
        """q_star at window slot t of a ``width``-token window, first of 1 + others rows."""
        n = 1 + others
        q = torch.randn(n, hq, width, d, generator=gen).to(DEV, DTYPE)
        q[0, :, t] = q_star
        slots = torch.tensor([slot] + [(slot + 1 + i) % 9 for i in range(others)], dtype=torch.int32, device=DEV)
        lengths = [pos + 1 + (width - 1 - t)] + [int(x) for x in torch.randint(width, max_len, (others,), generator=gen)]
        kv_len = torch.tensor(lengths, dtype=torch.int32, device=DEV)
        tickets = torch.zeros(n * hkv, dtype=torch.int32, device=DEV)
        splits = invariant_split_plan(max_len, n, hkv)
        splits = replace(splits, programs=min(programs, splits.count)) if programs else splits
        return attend(q, k, v, slots, kv_len, True, splits, tickets=tickets)[0, :, t]

    alone = run(1, 0, 0)
    for width, t, others in [(5, 2, 0), (16, 0, 0), (16, 15, 2), (5, 4, 7), (1, 0, 7)]:
        assert torch.equal(run(width, t, others), alone), (width, t, others)


def test_a_verify_window_equals_the_decode_steps_it_replaces_inside_any_batch():
    """The whole target step (fused stack and LM head) over a row's three tokens in one window,
    beside two other rows, against three one-token steps of that row alone: every position's
    hidden state and logits, and the keys and values it cached, are bit-equal."""
    from draftline.backends.cuda.head import lm_logits
    from draftline.backends.cuda.kv import StaticKV
    from draftline.backends.cuda.linear import fuse
    from draftline.backends.cuda.ops import CudaOps
    from draftline.backends.cuda.views import CAUSAL, KVView
    from draftline.core.models.ops import Forward
    from draftline.core.models.loader import random_target

    target = random_target("tiny-qwen3", 0, DEV, DTYPE)
    fuse(target)

    def run(cache, ids, slots, start):  # the target's rows at positions start .. start + W - 1
        w = ids.shape[1]
        view = KVView(cache, slots, start + w, CAUSAL)
        return target.run(CudaOps(), Forward(start[:, None] + torch.arange(w, device=DEV), view, invariant=True), ids)
    cfg = target.config
    gen = torch.Generator().manual_seed(2)
    caches = [StaticKV(cfg.num_layers, 3, cfg.num_kv_heads, 96, cfg.head_dim, DTYPE, torch.device(DEV),
                       invariant=True) for _ in range(2)]
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    ids = torch.randint(0, cfg.vocab_size, (3, 3), generator=gen).to(DEV)
    start = torch.tensor([40, 7, 61], device=DEV)  # row 0 is the one compared
    slots = torch.tensor([1, 0, 2], device=DEV)
    with torch.no_grad():
        window, _ = run(caches[0], ids, slots, start)
        steps = [run(caches[1], ids[:1, t : t + 1], slots[:1], start[:1] + t)[0] for t in range(3)]
        for t, hidden in enumerate(steps):
            assert torch.equal(window[0, t], hidden[0, 0]), t
            assert torch.equal(lm_logits(target.lm_head, window[:, t : t + 1], True)[0],
                               lm_logits(target.lm_head, hidden, True)[0]), t
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a[1, :, :43], b[1, :, :43])


def test_a_prompt_prefills_alike_alone_and_beside_longer_prompts():
    """The invariant prefill: a 5-token prompt alone (width 5) and as the middle row of three
    prompts padded to 9 tokens: the keys and values it caches, its hidden states and its first
    token's logits are bit-equal."""
    from draftline.backends.cuda.head import lm_logits
    from draftline.backends.cuda.kv import StaticKV
    from draftline.backends.cuda.linear import fuse
    from draftline.backends.cuda.ops import CudaOps
    from draftline.backends.cuda.views import prefill_view
    from draftline.core.models.ops import Forward
    from draftline.core.models.loader import random_target

    target = random_target("tiny-qwen3", 0, DEV, DTYPE)
    fuse(target)
    cfg = target.config
    gen = torch.Generator().manual_seed(3)

    def prefill(cache, ids, slots):  # whole prompts from position 0, the invariant prefill
        w, group = ids.shape[1], cfg.num_heads // cfg.num_kv_heads
        positions = torch.arange(w, device=DEV)[None].repeat(ids.shape[0], 1)
        return target.run(CudaOps(), Forward(positions, prefill_view(cache, slots, w, group), invariant=True), ids)
    caches = [StaticKV(cfg.num_layers, 4, cfg.num_kv_heads, 32, cfg.head_dim, DTYPE, torch.device(DEV),
                       invariant=True) for _ in range(2)]
    batch = torch.randint(0, cfg.vocab_size, (3, 9), generator=gen).to(DEV)
    prompt = batch[1, :5].clone()
    batch[1, 5:] = 0  # the padding after the prompt
    with torch.no_grad():
        alone, _ = prefill(caches[0], prompt[None], torch.tensor([2], device=DEV))
        beside, _ = prefill(caches[1], batch, torch.tensor([0, 2, 3], device=DEV))
    assert torch.equal(alone[0], beside[1, :5])
    assert torch.equal(lm_logits(target.lm_head, alone[:, 4], True), lm_logits(target.lm_head, beside[1:2, 4], True))
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a[2, :, :5], b[2, :, :5])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-dflash", "tiny-eagle3", "tiny-gemma4-mtp"])
def test_drafting_never_changes_a_token_with_invariant_kernels(name):
    """The shipped trained pair in bf16 on the GPU, greedy, drafting forced on, batches of 1, 4
    and 16 mixed prompts: every prompt's output equals `none`'s, token for token."""
    from conftest import respec
    from draftline.core.engine import Engine
    from draftline.core.sampling import SamplingParams
    from draftline.core.spec import load_spec
    from draftline.core.training.corpus import read_prompts

    spec = respec(load_spec(f"specs/{name}.yaml"), "cuda", device="cuda", dtype="bfloat16", batch_invariant=True,
                  max_batch_size=16)
    engine = Engine(spec, draft_policy="always")
    base = engine.with_method({"method": "none"})
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[:16]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for batch in (1, 4, 16):
        for i in range(0, len(prompts), batch):
            got = engine.generate(prompts[i : i + batch], params, trace=True)
            want = base.generate(prompts[i : i + batch], params)
            assert [c.output_ids for c in got] == [c.output_ids for c in want], (batch, i)
            assert sum(r.accepted for c in got for r in c.rounds) > 0  # drafts were accepted


def test_a_window_too_wide_for_the_invariant_tile_is_refused_only_when_the_spec_asks_for_it():
    """model.batch_invariant unset: on where the verify window's query rows per kv head fit the
    invariant attention tile, off (with a warning) where they do not; true: refused there."""
    from types import SimpleNamespace

    from draftline.backends.cuda.backend import _invariant
    from draftline.core.contract import Capacity
    from draftline.core.models.config import ConfigError

    cfg = SimpleNamespace(num_heads=16, num_kv_heads=2)  # 8 query heads per kv head
    assert _invariant(Capacity(4, 64, invariant=True), cfg, 8)  # 8 x 8 = 64 rows: fits
    assert not _invariant(Capacity(4, 64, invariant=True), cfg, 9)
    assert not _invariant(Capacity(4, 64, invariant=False), cfg, 1)
    with pytest.raises(ConfigError, match="exceeds the invariant attention tile.*batch_invariant: false"):
        _invariant(Capacity(4, 64, invariant=True, invariant_required=True), cfg, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-dflash", "tiny-eagle3", "tiny-gemma4-mtp"])
def test_seeded_sampled_requests_are_the_same_with_drafting_on_off_and_auto(name):
    """The spec's default kernels (batch-invariant) in bf16 on the GPU: seeded sampled requests
    emit the same tokens with drafting forced on, with `none`, and with the `auto` policy,
    alone and in a batch of 8 (argmax drafts are accepted against the target's own keyed draw,
    which plain decoding makes too; drafts sampled from q, as the shipped specs draft for sampled
    requests, are lossless in law, not token for token)."""
    from conftest import argmax_drafts, respec
    from draftline.core.engine import Engine
    from draftline.core.sampling import SamplingParams
    from draftline.core.spec import load_spec
    from draftline.core.training.corpus import read_prompts

    spec = respec(load_spec(f"specs/{name}.yaml"), "cuda", device="cuda", dtype="bfloat16", max_batch_size=8)
    spec = argmax_drafts(spec)
    engine = Engine(spec, draft_policy="always")
    assert engine.backend.cache.invariant  # the default
    engines = [engine, engine.with_method({"method": "none"}),
               Engine(spec, target=engine.target, tokenizer=engine.tokenizer, draft_policy="auto")]
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[:8]
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_new_tokens=48, ignore_eos=True) for i in range(8)]
    for batch in (1, 8):
        outs = [[c.output_ids for i in range(0, 8, batch) for c in e.generate(prompts[i : i + batch], params[i : i + batch])]
                for e in engines]
        assert outs[0] == outs[1] == outs[2], batch


@pytest.mark.gpu
def test_eval_on_the_cuda_backend_reports_every_prompt_identical(capsys):
    """`draftline eval` on the shipped GPU specs (the trained pair, bf16, batch-invariant
    kernels by default), greedy: its lossless check prints N/N identical for every method."""
    import json

    from draftline.cli import main

    specs = [f"specs/gpu-{m}.yaml" for m in ("dflash", "eagle3", "gemma4-mtp")]
    assert main(["eval", *specs, "--num-prompts", "12", "--temperatures", "0", "--json"]) == 0
    results = json.loads(capsys.readouterr().out.splitlines()[0])
    assert [r["lossless_check"] for r in results] == ["12/12 identical"] * 3
    assert all(r["tau"] > 2 for r in results)  # drafts were accepted


def test_prefill_windows_batched_into_one_launch_equal_one_launch_each(monkeypatch):
    """The invariant prefill's attention takes a prompt's windows as rows of few launches; each
    window's output is bit-equal to that window attended in a launch of its own (three whole
    windows and a shorter one, two prompts, a launch holding two windows of both)."""
    from draftline.backends.cuda import views
    from draftline.backends.cuda.kv import StaticKV

    hq, hkv, d, chunk = 8, 2, 32, 16  # 4 query heads a kv head: 16 tokens fill a 64-row window
    cache = StaticKV(1, 4, hkv, 128, d, DTYPE, torch.device(DEV), invariant=True)
    gen = torch.Generator().manual_seed(5)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen).to(DTYPE))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen).to(DTYPE))
    slots = torch.tensor([3, 1], device=DEV)
    w = 3 * chunk + 5
    q = torch.randn(2, hq, w, d, generator=gen).to(DEV, DTYPE)
    ends = torch.arange(chunk, w + chunk, chunk, device=DEV).clamp(max=w)
    kv_lens = ends.to(torch.int32)[:, None].expand(-1, 2).contiguous()
    splits = cache.splits(2)
    per_row = hkv * triton.next_power_of_2(splits.count) * (splits.rows or chunk) * d * 4
    monkeypatch.setattr(views, "PARTIALS_BYTES", per_row * 2 * 2)  # two windows of both prompts a launch
    view = views.KVView(cache, slots, kv_lens[-1], views.WINDOWS, window_lens=kv_lens, chunk=chunk)
    batched = view.attend(q, 0)
    for i, start in enumerate(range(0, w, chunk)):
        one = attend(q[:, :, start : start + chunk].contiguous(), cache.k[0], cache.v[0], slots, kv_lens[i], True, splits)
        assert torch.equal(batched[:, :, start : start + chunk], one), f"window {i}"
