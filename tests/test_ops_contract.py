"""The operations contract (core/models/ops.py), one operation at a time: each cuda operation
(backends/cuda/ops.py) against the eager one (core/models/eager.py) on the same module and
inputs, shapes included; attention and the KV store under each mask kind a forward uses
(causal rows, a non-causal block, queries over frozen keys). Without a GPU the kernels run in
Triton's interpreter. The whole-forward comparisons are tests/test_cuda_attention.py's."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from draftline.backends.cuda.attention import CacheAttention  # noqa: E402
from draftline.backends.cuda.kv import StaticKV  # noqa: E402
from draftline.backends.cuda.linear import fuse  # noqa: E402
from draftline.backends.cuda.ops import CudaOps  # noqa: E402
from draftline.backends.cuda.views import BLOCK, CAUSAL, FROZEN, KVView  # noqa: E402
from draftline.core.models.eager import EAGER, heads, project_kv  # noqa: E402
from draftline.core.models.layers import rotate  # noqa: E402
from draftline.core.models.loader import random_target  # noqa: E402
from draftline.core.models.ops import Forward  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CLOSE = {"rtol": 1e-4, "atol": 1e-4}
N, W = 2, 5  # rows, window


@pytest.fixture(scope="module")
def target():
    model = random_target("tiny-qwen3", 0, DEV)
    fuse(model)  # the cuda operations read the fused q/k/v and gate/up weights
    return model


def _inputs(target, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, W, target.config.hidden_size, generator=gen).to(DEV)
    positions = torch.tensor([3, 20], device=DEV)[:, None] + torch.arange(W, device=DEV)
    return x, positions, gen


def _twin_caches(cfg, gen):
    caches = [StaticKV(cfg.num_layers, 3, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, torch.device(DEV))
              for _ in range(2)]
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    return caches


@torch.no_grad()
def test_linear_then_norm_and_the_deferred_residual(target):
    """linear's result is opaque until a norm reads it: norm(linear(x)), add_norm with a residual
    (the sum and its norm) and without one (the stream's start) equal the eager ones."""
    layer = target.model.layers[0]
    x, positions, gen = _inputs(target)
    fwd = Forward(positions, None)
    residual = torch.randn(N, W, target.config.hidden_size, generator=gen).to(DEV)
    for ops in (EAGER, CudaOps()):
        partial = ops.linear(fwd, x, layer.self_attn.o_proj)
        normed = ops.norm(fwd, partial, layer.post_attention_layernorm)
        assert normed.shape == (N, W, target.config.hidden_size)
    want = EAGER.norm(fwd, EAGER.linear(fwd, x, layer.self_attn.o_proj), layer.post_attention_layernorm)
    got = CudaOps().norm(fwd, CudaOps().linear(fwd, x, layer.self_attn.o_proj), layer.post_attention_layernorm)
    torch.testing.assert_close(got, want, **CLOSE)
    for res in (residual, None):
        want = EAGER.add_norm(fwd, EAGER.linear(fwd, x, layer.self_attn.o_proj), res, layer.input_layernorm)
        got = CudaOps().add_norm(fwd, CudaOps().linear(fwd, x, layer.self_attn.o_proj), res, layer.input_layernorm)
        for g, w in zip(got, want):
            assert g.shape == w.shape == (N, W, target.config.hidden_size)
            torch.testing.assert_close(g, w, **CLOSE)


@torch.no_grad()
def test_gated_product_and_the_head(target):
    """The gated MLP input (silu(gate) * up, one fused product), the LM head's logits and its
    argmax (no logits written), and a plain projection."""
    layer = target.model.layers[0]
    x, positions, _ = _inputs(target, 1)
    fwd = Forward(positions, None)
    want, got = EAGER.gated(fwd, x, layer.mlp), CudaOps().gated(fwd, x, layer.mlp)
    assert got.shape == want.shape == (N, W, target.config.intermediate_size)
    torch.testing.assert_close(got, want, **CLOSE)
    torch.testing.assert_close(CudaOps().project(x, layer.self_attn.o_proj), EAGER.project(x, layer.self_attn.o_proj),
                               **CLOSE)
    head = target.lm_head
    torch.testing.assert_close(CudaOps().logits(head, x), EAGER.logits(head, x), **CLOSE)
    assert torch.equal(CudaOps().argmax(head, x), EAGER.argmax(head, x))


@torch.no_grad()
def test_embeddings_beside_another_input(target):
    """A drafter's input: the token's embedding (scaled, or normed) beside another tensor."""
    layer = target.model.layers[0]
    gen = torch.Generator().manual_seed(2)
    table = target.model.embed_tokens.weight
    ids = torch.randint(0, table.shape[0], (N, W), generator=gen).to(DEV)
    other = torch.randn(N, W, table.shape[1], generator=gen).to(DEV)
    torch.testing.assert_close(CudaOps().embed_beside(table, ids, 0.5, other), EAGER.embed_beside(table, ids, 0.5, other),
                               **CLOSE)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    torch.testing.assert_close(CudaOps().normed_beside(table, ids, norms[0], other, norms[1]),
                               EAGER.normed_beside(table, ids, norms[0], other, norms[1]), **CLOSE)
    assert torch.equal(CudaOps().embed(table, ids), EAGER.embed(table, ids))


@pytest.mark.parametrize("mask", [CAUSAL, BLOCK])
@torch.no_grad()
def test_attention_and_the_kv_store_under_each_mask(target, mask):
    """q/k/v with rope, the keys stored at the rows' positions, and attention over the cached
    prefix and the window, causal (verify, prefill) or as one block (a DFlash block): the
    output and every stored key and value; then store_kv alone (a drafter's context write)."""
    layer, rotary = target.model.layers[0], target.rotary
    x, positions, gen = _inputs(target, 3)
    caches = _twin_caches(target.config, gen)
    slots, start = torch.tensor([2, 0], device=DEV), positions[:, 0]
    eager = CacheAttention(caches[0].k, caches[0].v, slots, start + W, mask == CAUSAL, caches[0].splits(N))
    want = EAGER.attention(Forward(positions, eager), 0, layer.self_attn, x, rotary)
    got = CudaOps().attention(Forward(positions, KVView(caches[1], slots, start + W, mask)), 0, layer.self_attn, x,
                              rotary)
    assert got.shape == want.shape == (N, W, target.config.num_heads * target.config.head_dim)
    torch.testing.assert_close(got, want, **CLOSE)
    k, v = project_kv(layer.self_attn, x, *rotary(positions, x.dtype))  # [N, Hkv, W, D] each: the eager keys
    for i in range(N):
        caches[0].k[1][slots[i], :, positions[i]] = k[i]
        caches[0].v[1][slots[i], :, positions[i]] = v[i]
    CudaOps().store_kv(Forward(positions, KVView(caches[1], slots, start + W, mask)), 1, layer.self_attn, x, rotary)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_queries_over_frozen_keys_store_nothing(target):
    """A query-only attention over another model's keys (the MTP drafter over the target's
    verified cache): one query position a row, the cache untouched."""
    layer, rotary = target.model.layers[0], target.rotary
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(N, 1, target.config.hidden_size, generator=gen).to(DEV)
    caches = _twin_caches(target.config, gen)
    slots, start = torch.tensor([1, 2], device=DEV), torch.tensor([9, 30], device=DEV)
    positions = start[:, None]
    before = [t.clone() for t in caches[1].k + caches[1].v]
    frozen = KVView(caches[1], slots, start, FROZEN, read_layer=0)  # keys before each row's position
    got = CudaOps().attention(Forward(positions, frozen), 0, layer.self_attn, x, rotary)
    assert got.shape == (N, 1, target.config.num_heads * target.config.head_dim)
    assert all(torch.equal(a, b) for a, b in zip(before, caches[1].k + caches[1].v))
    cos, sin = rotary(positions, x.dtype)  # the same queries over the same keys, eagerly
    q = heads(layer.self_attn.q_proj(x), layer.self_attn.num_heads, layer.self_attn.head_dim)
    if getattr(layer.self_attn, "q_norm", None) is not None:
        q = layer.self_attn.q_norm(q)
    q = rotate(q, cos, sin)
    group = target.config.num_heads // target.config.num_kv_heads
    for i in range(N):
        n = int(start[i])
        k = caches[0].k[0][slots[i], :, :n].repeat_interleave(group, 0)  # [Hq, n, D]
        v = caches[0].v[0][slots[i], :, :n].repeat_interleave(group, 0)
        w = torch.softmax(q[i] @ k.transpose(-1, -2) / layer.self_attn.head_dim**0.5, dim=-1) @ v  # [Hq, 1, D]
        torch.testing.assert_close(got[i, 0], w.transpose(0, 1).reshape(-1), **CLOSE)
