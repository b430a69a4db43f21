"""The FP8 product's decode tiling against the one before it, at the 8B's shapes (CUDA machine).

`python3 bench/fp8_rows.py`: µs a product at 1, 4, 16 and 64 rows for q/k/v, o, gate/up and
down of one Qwen3-8B layer (random e4m3 weights in 128 x 128 blocks), with the former tiling
(activation rows on the matrix units' wide side) and the current one (weight rows there); and
whether a row's result is the same at every row count under the current tiling.
"""
import torch
import triton.testing as tt

from draftline.backends.cuda.fp8 import Fp8Tiling, Fp8Weight, fp8_product, fp8_tiling
from draftline.backends.cuda.matvec import row_tile
from draftline.core.models.fp8 import quantize_weight

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (12288, 4096, True),
          "down": (4096, 12288, False)}


def main() -> None:
    total: dict[int, tuple[float, float]] = {}
    for name, (n, k, gated) in SHAPES.items():
        q, s = quantize_weight(torch.randn(2 * n if gated else n, k, device="cuda") * 0.02, (128, 128))
        w8 = Fp8Weight(q.contiguous(), s.contiguous(), 128)
        x64 = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        line = []
        for m in (1, 4, 16, 64):
            x = x64[:m].contiguous()
            now = fp8_tiling(m, n, k, gated, True)
            before = Fp8Tiling(row_tile(m, 16), 32 if gated else 128, now.split, 4, 6 if gated else 4, swap=False)
            a = tt.do_bench_cudagraph(lambda: fp8_product(x, w8, gated, tiling=before), rep=40) * 1000
            b = tt.do_bench_cudagraph(lambda: fp8_product(x, w8, gated, tiling=now), rep=40) * 1000
            same = torch.equal(fp8_product(x, w8, gated, tiling=now)[..., :1, :],
                               fp8_product(x64, w8, gated, tiling=now)[..., :1, :])
            total[m] = (total.get(m, (0.0, 0.0))[0] + a, total.get(m, (0.0, 0.0))[1] + b)
            line.append(f"m={m}: {a:.1f} / {b:.1f}{'' if same else ' (row 0 differs from 64 rows)'}")
        print(f"{name}: before / now us  " + "; ".join(line), flush=True)
    print("one layer, before / now us: " + "; ".join(f"m={m}: {a:.1f} / {b:.1f}" for m, (a, b) in total.items()))


if __name__ == "__main__":
    main()
