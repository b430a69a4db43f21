"""The batch-invariant matvec at many rows (verify windows, prefills): which tile shapes keep a
row's bits and how fast they run, at the linear shapes of an 8B model.

`python bench/gemm_probe.py [M,...] [SHAPE,...] [--split=S]` (CUDA machine; shapes among
SHAPES' names; --split: K chunks S instead of the invariant tiling's, to price another
chunking at one row and at many; the gated shape keeps its whole sums, which its form needs). For each weight shape and row count M it
runs the invariant form's one-row program shape (its tiling fixed by N and K), wider shapes (more
columns, other K steps, warps and stages a program) and the one matvec chooses for M (wide),
checks each against the one-row tiling's result bit for bit (partial sums added in the
consumer's order, then rounded), and prints µs and TFLOP/s beside the matrix library's."""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from draftline.backends.cuda.matvec import invariant_tiling, matvec

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (12288, 4096, True),
          "down": (4096, 12288, False), "head": (151936, 4096, False)}


def whole(y: torch.Tensor) -> torch.Tensor:
    """A matvec's result as its consumer reads it: partial sums added in order, then rounded."""
    if y.dim() == 2:
        return y
    acc = y[0].clone()
    for part in y[1:]:
        acc += part
    return acc.to(torch.bfloat16)


def candidates(base, gated: bool):
    """Program shapes over the same K chunks: (column block, K step, warps, stages)."""
    if gated:
        shapes = ((64, 128, 4, 3), (64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4))
    else:
        shapes = ((128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 64, 8, 4), (128, 64, 8, 5),
                  (256, 64, 8, 3), (256, 64, 8, 4))
    return [replace(base, block_n=bn, block_k=bk, warps=wp, stages=st) for bn, bk, wp, st in shapes]


def one_row_shape(x, w, base, gated):
    """The one-row tiling's result over every row, 64 rows a launch (below WIDE_ROWS)."""
    parts = [matvec(x[i : i + 64], w, base, gated, invariant=True) for i in range(0, x.shape[0], 64)]
    return whole(torch.cat(parts, dim=-2))


def _label(t) -> str:
    return str((t.block_n, t.block_k, t.warps, t.stages))


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    split = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--split=")), 0)
    ms = [int(v) for v in args[0].split(",")] if args else [128, 256, 512, 1024]
    names = args[1].split(",") if len(args) > 1 else list(SHAPES)
    torch.manual_seed(0)
    print(f"{'shape':<8}{'M':>6} {'tiling (bn, bk, warps, stages)':<34}{'equal':>6}{'us':>9}{'TFLOP/s':>9}")
    for name in names:
        n, k, gated = SHAPES[name]
        w = torch.randn((2 if gated else 1) * n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        base = invariant_tiling(n, k, gated)
        base = replace(base, split=split) if split and not gated else base
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = one_row_shape(x, w, base, gated)
            flop = 2 * m * k * n * (2 if gated else 1)
            rows = [("library", True, do_bench(lambda: F.linear(x, w), warmup=10, rep=50, return_mode="median"))]
            for t in [base] + candidates(base, gated) + ["chosen"]:
                given = t != "chosen"
                t = t if given else base
                try:
                    same = torch.equal(whole(matvec(x, w, t, gated, invariant=True, as_given=given)), ref)
                    us = do_bench(lambda: matvec(x, w, t, gated, invariant=True, as_given=given), warmup=10,
                                  rep=50, return_mode="median")
                except Exception as err:  # a tiling past the registers or shared memory
                    print(f"{name:<8}{m:>6} {_label(t):<34} failed: {type(err).__name__}")
                    continue
                rows.append((_label(t) + (" one-row" if t == base and given else "" if given else " chosen"), same, us))
            for label, same, ms_ in rows:
                print(f"{name:<8}{m:>6} {label:<34}{'yes' if same else 'NO':>6}{1e3 * ms_:9.1f}{flop / ms_ / 1e9:9.1f}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
