"""Drafters with sliding-window layers and multi-layer EAGLE-3 heads on the cuda backend's
drafter caches, held to the reference backend: the windowed attention kernel against the
reference's explicit masks in every mode, and each drafter's rounds (the calls the cuda
backend makes: prefill, the verify step's context update, the draft step) against the
reference drafter's over a scripted generate, float32, greedy. Without a GPU the kernels run
in the Triton interpreter; the target is not run (fixed features per position), so each test
takes seconds."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from draftline.backends.cuda.kv import Rows, StaticStore  # noqa: E402
from draftline.backends.cuda.linear import fuse  # noqa: E402
from draftline.backends.cuda.ops import CudaOps  # noqa: E402
from draftline.backends.cuda.sliding import ANCHOR_BLOCK, ANCHOR_OWN, ANCHOR_ROW, Window, attend_window  # noqa: E402
from draftline.backends.reference.kv import ReferenceKV  # noqa: E402
from draftline.backends.reference.kv import attend as reference_attend  # noqa: E402
from draftline.core.contract import DraftRows  # noqa: E402
from draftline.core.machine import Plan  # noqa: E402
from draftline.core.methods.dflash import DFlashDrafter  # noqa: E402
from draftline.core.methods.eagle3 import Eagle3Drafter  # noqa: E402
from draftline.core.models.eagle3 import load_eagle3  # noqa: E402
from conftest import z_lab_sliding_dflash  # noqa: E402
from draftline.core.models.loader import load_dflash, random_target  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
# (accepted drafts, the next token) per round: runs of every length, so windows cross the chains
SCRIPT = [(2, 11), (0, 201), (3, 40), (1, 7), (0, 99)]


@pytest.mark.parametrize("size", [1, 3, 6, 40])
def test_window_kernel_matches_reference_masks(size):
    """Rows of different lengths in shuffled slots, GQA 2:1: causal windows measured from each
    query and from a per-row anchor (a chain's start), and a DFlash block's window (the last
    `size` context positions; the block causal or not), as the reference masks them."""
    gen = torch.Generator().manual_seed(size)
    n, hq, hkv, w, d = 3, 4, 2, 4, 32
    k_cache, v_cache = (torch.randn(5, hkv, 64, d, generator=gen).to(DEV) for _ in range(2))
    slots, kv_len = torch.tensor([3, 0, 4], device=DEV), torch.tensor([4, 21, 50], device=DEV)
    q = torch.randn(n, hq, w, d, generator=gen).to(DEV)
    anchors = kv_len - w + torch.tensor([0, 1, 2], device=DEV)  # queries past them keep the anchor's window
    cases = [(Window(size, True), dict(causal=True)),
             (Window(size, True, ANCHOR_ROW, anchors), dict(causal=True)),
             (Window(size, False, ANCHOR_BLOCK), dict(causal=False)),
             (Window(size, True, ANCHOR_BLOCK), dict(causal=False, block_causal=True)),
             (Window(size, True, ANCHOR_OWN), dict(causal=False, per_query=True))]
    for window, how in cases:
        got = attend_window(q, k_cache, v_cache, slots, kv_len, window)
        for i in range(n):
            keys = k_cache[slots[i], :, : kv_len[i]], v_cache[slots[i], :, : kv_len[i]]
            anchor = int(anchors[i]) if window.anchor == ANCHOR_ROW else None
            want = reference_attend(q[i], *keys, window=size, anchor=anchor, **how)
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5, msg=f"{window.anchor}, {how}, row {i}")


def _rows(store_rows: Rows, last: int, start: int, features: torch.Tensor | None = None, device: str = DEV
          ) -> DraftRows:
    return DraftRows(last_token=torch.tensor([last], device=device), start=torch.tensor([start], device=device),
                     batch=None, caches=store_rows, features=features)


def _store(model) -> StaticStore:
    """The cuda backend's drafter store over ``model``'s fused weights, its caches made."""
    fuse(model)
    store = StaticStore(2, 64, torch.device(DEV), CudaOps())
    store.allocate(model)
    return store


def _eagle_rounds(name: str) -> tuple[list, list]:
    """The reference drafter's and the positional (cuda) drafter's drafts, round by round."""
    k, taps = 3, (0, 1, 2)
    plan = Plan(method="eagle3", drafting="chain", num_speculative_tokens=k, target_layer_ids=taps)
    ref = Eagle3Drafter(load_eagle3(FIXTURES / name), None, ReferenceKV(), plan)  # its own embedding
    model = load_eagle3(FIXTURES / name).to(DEV)
    store = _store(model)
    cuda = Eagle3Drafter(model, None, store, plan)
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(40, 3 * 128, generator=gen)  # the target's features at each position
    tokens = torch.randint(0, 256, (6,), generator=gen).tolist()
    req = SimpleNamespace(draft_state=None, token_ids=list(tokens))
    creq = SimpleNamespace(draft_state=None)
    cuda.admit(creq)
    slots = torch.tensor([creq.draft_state.index], device=DEV)
    with torch.no_grad():
        ref.extend(req, feats[: len(tokens) - 1], 0)
        cuda.prefill_rows(_rows(Rows(slots), 0, 0),
                          feats[None, : len(tokens)].to(DEV), torch.tensor([tokens], device=DEV))
        got, want = [], []
        for accepted, nxt in SCRIPT:
            start = len(req.token_ids) - 1
            want.append(ref.propose([req], None).tokens[0].tolist())
            rows = _rows(Rows(slots), req.token_ids[-1], start,
                         feats[start - 1][None].to(DEV))
            got.append(cuda.propose([], rows).tokens[0].tolist())
            window = [req.token_ids[-1]] + got[-1]  # the verify step's ids, and its features
            cuda.extend_rows(rows, feats[None, start : start + k + 1].to(DEV), torch.tensor([window], device=DEV))
            req.token_ids = req.token_ids + want[-1][:accepted] + [nxt]
            ref.extend(req, feats[start : len(req.token_ids) - 1], start)
    return got, want


@pytest.mark.parametrize("name", ["sliding-window", "two-layers"])
def test_eagle3_heads_draft_on_the_cuda_caches_as_on_the_reference(name):
    """A sliding-window head (window 4) and a two-layer head (its second layer sliding, window
    3) through the fused chain: the same drafts every round as the reference's cached chain."""
    got, want = _eagle_rounds(name)
    assert got == want


def _dflash_rounds(folder: Path) -> tuple[list, list]:
    target = random_target("tiny-qwen3", 0)  # its embedding and lm_head only
    model = load_dflash(folder)
    blk = model.config.block_size
    plan = Plan(method="dflash", drafting="parallel", num_speculative_tokens=blk - 1, target_layer_ids=(-1, 2, 5),
                block_size=blk)
    ref = DFlashDrafter(model, target, ReferenceKV(), plan, 257)
    # its own target: Module.to moves in place, and the reference drafter keeps the CPU one
    cuda_model = load_dflash(folder).to(DEV)
    store = _store(cuda_model)
    cuda = DFlashDrafter(cuda_model, random_target("tiny-qwen3", 0).to(DEV), store, plan, 257)
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(40, 3 * 128, generator=gen)
    tokens = torch.randint(0, 256, (6,), generator=gen).tolist()
    req, creq = SimpleNamespace(draft_state=None), SimpleNamespace(draft_state=None)
    cuda.admit(creq)
    slots = torch.tensor([creq.draft_state.index], device=DEV)
    got, want = [], []
    with torch.no_grad():
        ref.extend(req, feats[: len(tokens) - 1], 0)
        cuda.prefill_rows(_rows(Rows(slots), 0, 0),
                          feats[None, : len(tokens) - 1].to(DEV), torch.tensor([tokens[:-1]], device=DEV))
        for accepted, nxt in SCRIPT:
            start = len(tokens) - 1
            want.append(ref.propose([req], _rows([req.draft_state], tokens[-1], start, device="cpu")).tokens[0].tolist())
            rows = _rows(Rows(slots), tokens[-1], start)
            got.append(cuda.propose([], rows).tokens[0].tolist())
            # the verify step's context update: the window's features at start .. start + K
            cuda.extend_rows(rows, feats[None, start : start + blk].to(DEV), torch.zeros(1, blk, dtype=torch.long, device=DEV))
            tokens = tokens + want[-1][: accepted] + [nxt]
            ref.extend(req, feats[start : len(tokens) - 1], start)
    return got, want


@pytest.mark.parametrize("name", ["dflash-sliding-window", "dflash-sliding-non-causal", "z-lab"])
def test_sliding_dflash_drafts_on_the_cuda_caches_as_on_the_reference(name, tmp_path):
    """Sliding DFlash layers (window 3) in the captured draft step's fused stack: speculators'
    (the block over the last three context positions, the block causal or not) and z-lab's
    (each block query over the three keys ending at itself, causal): the same drafts every
    round as the reference drafter's."""
    folder = z_lab_sliding_dflash(tmp_path / "z") if name == "z-lab" else FIXTURES / name
    assert load_dflash(folder).config.windows() == {0: 3}
    got, want = _dflash_rounds(folder)
    assert got == want
