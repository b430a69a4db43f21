"""Why an FP8 product at 1-4 rows takes twice 16 rows' time: same tiling, M differs."""
import torch, triton
import triton.testing as tt
from draftline.backends.cuda import fp8 as F
from draftline.backends.cuda.fp8 import Fp8Weight, fp8_product, fp8_tiling
from draftline.core.models.fp8 import quantize_weight

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (12288, 4096, True), "down": (4096, 12288, False)}

def launch(x, w, gated, m_arg, t):
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    groups = triton.cdiv(k, 128)
    out = torch.empty(t.split, max(m, 16), n, dtype=torch.float32, device=x.device) if t.split > 1 else torch.empty(max(m, 16), n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m_arg, t.block_m), triton.cdiv(n, t.block_n), t.split)
    return F._fp8_rows[grid](x, w.weight, w.scale, out, m_arg, n, k, w.scale.shape[1], groups // t.split,
        GATED=gated, SPLIT=t.split, SCALE_ROWS=w.scale_rows, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        EXACT_CAST=True, SWAP=t.swap, PDL=False, num_warps=t.warps, num_stages=t.stages)

import triton.language as tl
from draftline.backends.cuda.matvec import _epilogue


@triton.jit
def _quantized_clamped(x, rm, rk, M, K):
    rows = tl.minimum(rm, M - 1)  # rows past M re-read the last one: no row mask on the load
    xt = tl.load(x + rows[:, None].to(tl.int64) * K + rk[None, :], mask=rk[None, :] < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(xt), axis=1), 448.0), 1e-12)
    q = tl.minimum(tl.maximum(tl.math.div_rn(xt, scale[:, None]), -448.0), 448.0)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _rows_clamped(x, w, s, out, M, N, K, G, GROUPS_PER_SPLIT, GATED: tl.constexpr, SPLIT: tl.constexpr,
                  SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pm, pn, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    first = pk * GROUPS_PER_SPLIT
    acc_gt = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_ut = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for g in range(first, first + GROUPS_PER_SPLIT):
        rk = g * 128 + tl.arange(0, 128)
        q, sx = _quantized_clamped(x, rm, rk, M, K)
        acc_gt += F._group_swapped(q, sx, w, s, rn, rk, N, K, G, SCALE_ROWS, g)
        if GATED:
            acc_ut += F._group_swapped(q, sx, w, s, rn + N, rk, 2 * N, K, G, SCALE_ROWS, g)
    _epilogue(tl.trans(acc_gt), tl.trans(acc_ut), out, out, out, out, out, out, out, out, rm, rn, M, N, 1, 0, pk,
              x.dtype.element_ty, GATED, SPLIT, False, False)


def clamped(x, w, gated, t):
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    groups = triton.cdiv(k, 128)
    out = torch.empty(t.split, m, n, dtype=torch.float32, device=x.device) if t.split > 1 else torch.empty(m, n, dtype=x.dtype, device=x.device)
    _rows_clamped[(triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.split)](
        x, w.weight, w.scale, out, m, n, k, w.scale.shape[1], groups // t.split, GATED=gated, SPLIT=t.split,
        SCALE_ROWS=w.scale_rows, BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages)
    return out


tot = {}
for name, (n, k, gated) in SHAPES.items():
    q, s = quantize_weight(torch.randn(2 * n if gated else n, k, device="cuda") * 0.02, (128, 128))
    w8 = Fp8Weight(q.contiguous(), s.contiguous(), 128)
    x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    row = []
    for m in (1, 2, 4, 16):
        t = fp8_tiling(m, n, k, gated, True)
        x = x16[:m].contiguous()
        xpad = torch.zeros(16, k, device="cuda", dtype=torch.bfloat16); xpad[:m] = x
        a = tt.do_bench_cudagraph(lambda: fp8_product(x, w8, gated, invariant=True), rep=40) * 1000
        b = tt.do_bench_cudagraph(lambda: launch(xpad, w8, gated, 16, t), rep=40) * 1000
        c = tt.do_bench_cudagraph(lambda: clamped(x, w8, gated, t), rep=40) * 1000
        same = torch.equal(clamped(x, w8, gated, t), fp8_product(x, w8, gated, invariant=True))
        tot[m] = [sum(v) for v in zip(tot.get(m, [0, 0, 0]), (a, b, c))]
        row.append(f"m={m} t={t.block_m}/{t.block_n}/{t.split}: product {a:.1f}, padded-16 {b:.1f}, clamped {c:.1f}{'' if same else ' DIFFERS'}")
    print(name, " | ".join(row), flush=True)
    if name == "qkv":
        t = fp8_tiling(1, n, k, gated, True)
        k1, k16 = launch(x16[:1].contiguous(), w8, gated, 1, t), launch(x16, w8, gated, 16, t)
        for key in ("ttgir", "ptx"):
            a1, a16 = k1.asm[key], k16.asm[key]
            print(key, "lines M=1:", a1.count("\n"), "M=16:", a16.count("\n"))
            if key == "ttgir":
                open("/tmp/m1.ttgir", "w").write(a1); open("/tmp/m16.ttgir", "w").write(a16)
        import subprocess, os
        d = subprocess.run(["diff", "/tmp/m1.ttgir", "/tmp/m16.ttgir"], capture_output=True, text=True).stdout
        os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
        open(os.path.join(os.environ.get("OUT", "/tmp"), "ttgir.diff"), "w").write(d)
        print("ttgir diff lines:", d.count("\n"))
        for kk in (k1, k16):
            print("regs", kk.n_regs, "spills", kk.n_spills, "shared", kk.metadata.shared)
print("layer totals:", {m: [round(v, 1) for v in vals] for m, vals in tot.items()})
