"""FP8 product tilings at the 8B's shapes: the shipped choice (fp8_tiling) against a sweep of
column blocks, K splits, warps and stages, per row count; each candidate checked against the
shipped product's values first. `python3 bench/fp8_tilings.py [ROWS, default 1,16]` (CUDA)."""
import itertools, sys, time
import torch, triton
import triton.testing as tt
from draftline.backends.cuda.fp8 import Fp8Weight, Fp8Tiling, fp8_product, fp8_tiling
from draftline.core.models.fp8 import quantize_weight

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (12288, 4096, True), "down": (4096, 12288, False)}
MS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,16").split(",")]
bw = {}
tot = {m: [0.0, 0.0] for m in MS}
best_of = {}
t0 = time.time()
for name, (n, k, gated) in SHAPES.items():
    q, s = quantize_weight(torch.randn(2 * n if gated else n, k, device="cuda") * 0.02, (128, 128))
    w8 = Fp8Weight(q.contiguous(), s.contiguous(), 128)
    nbytes = w8.weight.numel() + w8.scale.numel() * 4
    groups = triton.cdiv(k, 128)
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = fp8_product(x, w8, gated, invariant=True)
        ref = ref if ref.dim() == 2 else ref.sum(0)
        cur = fp8_tiling(m, n, k, gated, True)
        base = tt.do_bench_cudagraph(lambda: fp8_product(x, w8, gated, invariant=True), rep=30) * 1000
        res = []
        for bn, split, warps, stages in itertools.product((32, 64, 128) if gated else (64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 5)):
            if gated and split > 1 or groups % split or (bn == 256 and warps == 4):
                continue
            t = Fp8Tiling(cur.block_m, bn, split, warps, stages, swap=True)
            try:
                out = fp8_product(x, w8, gated, invariant=True, tiling=t)
                out = out if out.dim() == 2 else out.sum(0)
                if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
                    res.append((1e9, t, "WRONG")); continue
                us = tt.do_bench_cudagraph(lambda: fp8_product(x, w8, gated, invariant=True, tiling=t), rep=20) * 1000
                res.append((us, t, ""))
            except Exception as e:  # noqa
                res.append((1e9, t, type(e).__name__))
        res.sort(key=lambda r: r[0])
        b = res[0]
        tot[m][0] += base; tot[m][1] += b[0]
        print(f"{name:8s} m={m:3d} cur bn{cur.block_n}/s{cur.split}/w{cur.warps}/st{cur.stages}: {base:7.1f} us "
              f"({nbytes / base / 1e3:.2f} TB/s) | best bn{b[1].block_n}/s{b[1].split}/w{b[1].warps}/st{b[1].stages}: "
              f"{b[0]:7.1f} us ({nbytes / b[0] / 1e3:.2f} TB/s) | next: "
              + ", ".join(f"bn{r[1].block_n}/s{r[1].split}/w{r[1].warps}/st{r[1].stages} {r[0]:.1f}" for r in res[1:4]), flush=True)
print("layer totals us (current, best):", {m: [round(v, 1) for v in vals] for m, vals in tot.items()}, f"{time.time() - t0:.0f}s")
