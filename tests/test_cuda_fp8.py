"""The cuda backend's block-scaled FP8 product (backends/cuda/fp8.py) against the reference's
definition (core/models/fp8.py): odd shapes, the gated and split forms, stacked projections,
exact activation quantization, batch invariance; and the tiny FP8 pair on the cuda backend
against the reference backend with accepted drafts. On a CPU the kernels run under Triton's
interpreter in float32; on a GPU (marked) in bf16, with drafting held to plain decoding."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from conftest import argmax_drafts, respec  # noqa: E402
from draftline.backends.cuda.fp8 import Fp8Weight, fp8_product, pack  # noqa: E402
from draftline.core.engine import Engine  # noqa: E402
from draftline.core.models.fp8 import Fp8Linear, Fp8Scheme, fp8_linear, quantize_activations, quantize_weight  # noqa: E402
from draftline.core.sampling import SamplingParams  # noqa: E402
from draftline.core.spec import load_spec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA device (bf16 products and lossless drafting on it)")


def _linear(k: int, n: int, seed: int) -> Fp8Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = Fp8Linear(k, n, Fp8Scheme())
    w = torch.randn(n, k, generator=gen) * torch.linspace(0.02, 0.2, k)  # columns of different ranges
    lin.weight, lin.weight_scale_inv = (t.to(DEV) for t in quantize_weight(w, (128, 128)))
    return lin


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * torch.linspace(0.5, 4, k)).to(DEV, DTYPE)


def _whole(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y.sum(0).to(dtype) if y.dim() == 3 else y  # partial sums: the consumer adds them


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: to float32's rounding of the sum's order; bf16: to its rounding of the result."""
    tol = 1e-5 if DTYPE == torch.float32 else 2e-2
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("m, k, n", [(1, 256, 384), (5, 200, 130), (16, 384, 1024), (70, 384, 256), (3, 64, 40)])
def test_the_product_equals_the_reference_on_odd_shapes(m, k, n):
    lin, x = _linear(k, n, 0), _rows(m, k, 1)
    want = fp8_linear(x, lin.weight, lin.weight_scale_inv, lin.block)
    for invariant in (False, True):
        _close(_whole(fp8_product(x, pack([lin]), invariant=invariant), x.dtype), want)


def test_activations_quantize_exactly_as_the_reference():
    """Through an identity weight each output is one activation dequantized: the kernel's
    e4m3 rounding (ties to even, across binades) and its group scales are the reference's."""
    k = 256
    eye = Fp8Weight(torch.eye(k, device=DEV).to(torch.float8_e4m3fn), torch.ones(2, 2, device=DEV), 128)
    x = _rows(9, k, 2)
    x[0, :128] = torch.tensor([1.95, 7.9, 0.49, -3.99] * 32, device=DEV, dtype=DTYPE) * 3  # values rounding up a binade
    q, scale = quantize_activations(x, 128)
    want = q.float() * scale.repeat_interleave(128, -1)
    got = _whole(fp8_product(x, eye), torch.float32).float()
    # the kernel multiplies the scales in its own order (a float32 ulp) and may write the output
    # dtype (a bf16 ulp); neighbouring e4m3 values lie at least 6% apart, so a wrong rounding fails
    ulp = 2.0 ** -22 if x.dtype == torch.float32 else 2.0 ** -7
    assert ((got - want).abs() <= ulp * want.abs()).all()


def test_gated_and_stacked_projections_equal_their_parts():
    """q/k/v and gate/up stack into one weight (rows not filling 128-row blocks take a scale
    per row); the gated form writes silu(gate) * up."""
    x = _rows(4, 256, 3)
    for rows in ((200, 200), (256, 256)):
        gate, up = _linear(256, rows[0], 4), _linear(256, rows[1], 5)
        parts = [fp8_linear(x, lin.weight, lin.weight_scale_inv, lin.block).float() for lin in (gate, up)]
        w = pack([gate, up])
        assert w.scale_rows == (128 if rows[0] % 128 == 0 else 1)
        _close(fp8_product(x, w, gated=True), torch.nn.functional.silu(parts[0]) * parts[1])
    q, kk, v = _linear(256, 256, 6), _linear(256, 128, 7), _linear(256, 128, 8)
    w = pack([q, kk, v])
    assert q.weight.data_ptr() == w.weight.data_ptr()  # the modules' tensors are views of the stack
    kv = torch.cat([fp8_linear(x, lin.weight, lin.weight_scale_inv, lin.block) for lin in (kk, v)], -1)
    _close(_whole(fp8_product(x, w.rows_from(256)), x.dtype), kv)


@pytest.mark.parametrize("k, n", [(384, 256), (4096, 1024)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(k, n):
    lin = _linear(k, n, 9)
    w, x = pack([lin]), _rows(80, k, 10)
    alone = _whole(fp8_product(x[:1], w, invariant=True), x.dtype)
    for m in (2, 16, 17, 64, 80):
        assert torch.equal(_whole(fp8_product(x[:m], w, invariant=True), x.dtype)[:1], alone)


PROMPTS = ["import os\nclass A:\n    def run(self, n):", "def add(a, b):\n    "]


def _agree_until_a_tie(got: list[int], ref: list[int], ref_logprobs) -> None:
    """cuda's tokens equal the reference's up to the first position where the reference's two
    best tokens are within TIE nats: there one activation rounded to the other side of an e4m3
    step (float32 sums differ in their last bits) moves logits by about 0.1 and decides."""
    for k, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            (_, best), (_, second) = ref_logprobs[k].top[:2]
            assert best - second < TIE, f"position {k}: {a} != {b} with a margin of {best - second:.4f} nats"
            return


TIE = 0.05


def test_the_fp8_pair_on_the_cuda_backend_accepts_drafts_and_follows_the_reference():
    """The shipped tiny FP8 target with its bf16 DFlash drafter (float32): on the cuda backend,
    drafting (with drafts accepted) gives plain decoding's tokens, and plain decoding gives the
    reference backend's tokens except where the reference's choice is a near-tie."""
    spec = argmax_drafts(load_spec("specs/tiny-fp8-dflash.yaml"))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)
    runs = {}
    for backend in ("reference", "cuda"):
        for policy in ("never", "always"):
            eng = Engine(respec(spec, backend, max_batch_size=4, device=DEV, dtype="float32", max_model_len=128),
                         draft_policy=policy)
            runs[backend, policy] = eng.generate(PROMPTS, params, trace=True)
    drafted = runs["cuda", "always"]
    assert sum(x.accepted for c in drafted for x in c.rounds) >= 2  # drafts were accepted: the check has teeth
    for backend in ("reference", "cuda"):
        assert [c.output_ids for c in runs[backend, "always"]] == [c.output_ids for c in runs[backend, "never"]]
    for got, ref in zip(runs["cuda", "never"], runs["reference", "never"]):
        _agree_until_a_tie(got.output_ids, ref.output_ids, ref.logprobs)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dflash", "eagle3", "gemma4-mtp"])
def test_drafting_over_the_fp8_target_is_lossless_in_bf16(method):
    """bf16 on the GPU: with drafting, every request's tokens equal the FP8 target's plain
    decoding at batch 1, 4 and 16 (the batch-invariant products)."""
    from draftline.core.training.corpus import read_prompts

    spec = respec(load_spec(f"specs/tiny-fp8-{method}.yaml"), "cuda", max_batch_size=16, device="cuda",
                  dtype="bfloat16")
    prompts = read_prompts("specs/tiny/eval_prompts.jsonl")[:16]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    eng = Engine(spec, draft_policy="always")
    plain = [c.output_ids for c in eng.with_method({"method": "none"}).generate(prompts[:1], params)]
    for batch in (1, 4, 16):
        outs = eng.generate(prompts[:batch], params)
        alone = [c.output_ids for c in eng.with_method({"method": "none"}).generate(prompts[:batch], params)]
        assert [c.output_ids for c in outs] == alone
        assert outs[0].output_ids == plain[0]
        assert sum(c.meta_info["spec_accept_length"] for c in outs) / batch > 1.5
