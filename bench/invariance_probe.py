"""Batch-invariant matvec on the GPU: is a row's result bit-equal alone and among others, and
what does the guarantee cost against the plain form, at the linear shapes of an 8B model?

`python bench/invariance_probe.py` (CUDA machine). Prints, per weight shape: whether every row
of a 256-row product equals the same row computed alone and in batches of 5, 16 and 64 (tiles
sized by M), whether tiles of at most 16 and 64 rows round as the largest ones do (the matrix
units' instruction shape), and µs per launch of the invariant and plain forms at several M."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from draftline.backends.cuda.matvec import ROW_TILE, choose_tiling, invariant_tiling, matvec

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (12288, 4096, True),
          "down": (4096, 12288, False), "head": (151936, 4096, False)}


def _whole(y: torch.Tensor) -> torch.Tensor:
    return y.sum(0) if y.dim() == 3 else y.float()


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for name, (n, k, gated) in SHAPES.items():
        w = torch.randn((2 if gated else 1) * n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
        tiling = invariant_tiling(n, k, gated)
        full = _whole(matvec(x, w, tiling, gated, invariant=True))
        alone = torch.cat([_whole(matvec(x[i : i + 1], w, tiling, gated, invariant=True)) for i in range(0, 256, 37)])
        same = torch.equal(alone, full[0:256:37])
        for m in (5, 16, 64):
            same &= torch.equal(_whole(matvec(x[:m], w, tiling, gated, invariant=True)), full[:m])
        tiles = {t: torch.equal(_whole(matvec(x, w, tiling, gated, invariant=True, most=t)), full) for t in (16, 64)}
        times = []
        for m in (1, 16, 64, 256):
            xm = x[:m].contiguous()
            inv = do_bench(lambda: matvec(xm, w, tiling, gated, invariant=True), warmup=20, rep=100, return_mode="median")
            plain_tiling = choose_tiling(m, n, k, gated)
            if plain_tiling is not None:
                plain = do_bench(lambda: matvec(xm, w, plain_tiling, gated), warmup=20, rep=100, return_mode="median")
            else:
                plain = do_bench(lambda: F.linear(xm, w), warmup=20, rep=100, return_mode="median")
            times.append((m, 1e3 * inv, 1e3 * plain))
        rows.append((name, same, tiles, times))
    print(f"ROW_TILE {ROW_TILE}")
    print(f"{'shape':<8}{'rows equal':>11}{'16-row tiles':>13}{'64-row tiles':>13}   us invariant / plain at M = 1, 16, 64, 256")
    for name, same, tiles, times in rows:
        cells = "  ".join(f"{a:7.1f}/{b:<7.1f}" for _, a, b in times)
        print(f"{name:<8}{same!s:>11}{tiles[16]!s:>13}{tiles[64]!s:>13}   {cells}")


if __name__ == "__main__":
    main()
