"""The q/k/v kernel's GPU tile: (token, head) rows a program holds, timed and bit-checked (CUDA machine).

`python bench/qkv_tiles.py`: for the tiny target and the 8B shape, at several token counts, each
(TOKENS, HEADS) tile's µs a launch (inside a captured graph of 50 launches) and whether its q,
keys and values equal the one-row tile's bits."""
import torch

from draftline.backends.cuda import fused
from draftline.backends.cuda.kv import StaticKV
from draftline.core.models.layers import DecoderLayer, Rotary
from draftline.core.models.presets import target_preset

DEV = torch.device("cuda")
TILES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8)]
REPS = 50


def timed(layer, qkv, positions, rotary, cache, slots, kv_len, n, w) -> tuple[float, tuple]:
    run = lambda: fused._qkv(layer, qkv, positions, rotary, cache, 0, slots, kv_len, n, w)  # noqa: E731
    q = run()
    out = (q.clone(), cache.k[0].clone(), cache.v[0].clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / REPS)
    return best, out


def main():
    original = fused.qkv_tiles
    for name, sizes in (("tiny-qwen3", (1, 16, 64, 256)), ("qwen3-8b", (1, 16, 128, 512))):
        torch.manual_seed(0)
        cfg = target_preset(name)
        layer = DecoderLayer(cfg).to(DEV, torch.bfloat16)
        rotary = Rotary(cfg.rope, cfg.head_dim).to(DEV)
        heads = cfg.num_heads + 2 * cfg.num_kv_heads
        for tokens in sizes:
            n = min(tokens, 16)
            w = tokens // n
            slots = torch.arange(n, dtype=torch.int32, device=DEV)
            kv_len = torch.randint(w, 64, (n,), dtype=torch.int32, device=DEV)
            positions = (kv_len[:, None] - w + torch.arange(w, device=DEV)[None, :]).long()
            qkv = torch.randn(n * w, heads * cfg.head_dim, device=DEV, dtype=torch.bfloat16)
            base = None
            cells = []
            for t, hh in TILES:
                if hh > triton_pow2(heads) or t > tokens:
                    continue
                fused.qkv_tiles = lambda toks, hs, d, t=t, hh=hh: ((-(-toks // t), -(-hs // hh)), t, hh)
                cache = StaticKV(1, n, cfg.num_kv_heads, 64, cfg.head_dim, torch.bfloat16, DEV)
                cache.k[0].zero_(), cache.v[0].zero_()  # positions no token writes compare equal
                us, out = timed(layer, qkv, positions, rotary, cache, slots, kv_len, n, w)
                base = base or out
                same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(out, base))
                cells.append(f"{t}x{hh}:{us:.2f}{'' if same else '!'}")
            fused.qkv_tiles = original
            chosen = fused.heads_per_program(heads, cfg.head_dim)
            print(f"{name:10s} {tokens:4d} tokens (1x{chosen} in use)  " + "  ".join(cells), flush=True)
    print("(µs a launch per TOKENSxHEADS tile; ! = bits differ from 1x1)")


def triton_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


if __name__ == "__main__":
    main()
