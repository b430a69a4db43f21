"""Decode matvec tilings against cuBLAS on a CUDA machine, each shape of a Qwen3-8B layer over
36 distinct weights (as a forward streams them) replayed from one graph; and a kernel-by-kernel
profile of a round. `python bench/matvec_sweep.py` sweeps; `--chosen` times only the tilings
draftline.backends.cuda.matvec.choose_tiling picks; `--profile SPEC BATCH` profiles that round's graphs."""
import itertools
import sys
import torch
import torch.nn.functional as F
from draftline.backends.cuda.matvec import matvec, Tiling
from draftline.core.benchmark import graphed, median_ms

dev = torch.device("cuda")
H, Q, KV, I, V = 4096, 4096, 1024, 12288, 151936
SHAPES = {"qkv": (Q + 2 * KV, H), "o": (H, Q), "gate_up": (2 * I, H), "down": (H, I), "lm_head": (V, H)}


def profile_round(spec, batch, dump=None):
    """Kernel time by kernel over ten replays of one round's graphs (draft, verify) at a batch;
    with ``dump`` a path, every kernel's (name, start us, end us) in order go there as JSON."""
    from torch.profiler import profile, ProfilerActivity
    from draftline.core.engine import Engine
    from draftline.core.benchmark import _decode, _prompts
    eng = Engine.from_spec(spec, draft_policy="always")
    _decode(eng, _prompts(eng, batch, 512, 1), 32)
    graphs = [g for k, (g, _) in eng.backend.graphs._graphs.items() if k[-1 if k[0] == "draft" else 2] == batch]
    ms = median_ms(lambda: [g.replay() for g in graphs], 20)
    for k, (g, _) in eng.backend.graphs._graphs.items():
        if g in graphs:
            print(f"  graph {k[0]}: {median_ms(g.replay, 20):.3f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            for g in graphs:
                g.replay()
        torch.cuda.synchronize()
    print(f"{spec} batch {batch}: graphs {ms:.3f} ms per round")
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    print(f"{'kernel':70} {'us/round':>9} {'launches':>8}")
    for e in rows[:45]:
        print(f"{e.key[:70]:70} {e.device_time_total / 10:9.1f} {e.count // 10:8d}")
    print(f"{'all kernels':70} {sum(e.device_time_total for e in rows) / 10:9.1f} {sum(e.count for e in rows) // 10:8d}")
    if dump:
        import json
        from torch.autograd import DeviceType
        kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
        with open(dump, "w") as f:
            json.dump([(e.name, e.time_range.start, e.time_range.end) for e in kernels], f)


def graph_ms(fn):
    return median_ms(graphed(fn), 10)  # replayed from one graph: no launch gaps


def shape_weights(name, n, k):
    """36 distinct weights (a forward streams one per layer); the LM head, 1.2 GB, once x 4."""
    if name == "lm_head":
        return [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02] * 4
    return [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(36)]


def sweep(name, weights, m, tilings, gated):
    n, k = weights[0].shape
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    nbytes = sum(w.numel() * 2 for w in weights)
    if gated:
        base = graph_ms(lambda: [F.silu((y := F.linear(x, w)).narrow(1, 0, n // 2)) * y.narrow(1, n // 2, n // 2) for w in weights])
    else:
        base = graph_ms(lambda: [F.linear(x, w) for w in weights])
    # correctness of one config against cuBLAS
    res = []
    for t in tilings:
        try:
            out = matvec(x, weights[0], t, gated=gated)
            out = out.sum(0) if t.split > 1 else out.float()
            ref = F.linear(x.float(), weights[0].float())
            if gated:
                ref = F.silu(ref[:, : n // 2]) * ref[:, n // 2:]
            err = ((out - ref).norm() / ref.norm()).item()
            ms = graph_ms(lambda: [matvec(x, w, t, gated=gated) for w in weights])
            res.append((ms, t, err))
        except Exception as e:  # a tiling that does not fit
            print("  skip", t, type(e).__name__, str(e)[:80])
    res.sort(key=lambda r: r[0])
    print(f"{name} M={m}: cuBLAS {1e3*base/len(weights):.1f} us/mat {nbytes/base/1e9:.2f} TB/s")
    for ms, t, err in res[:4]:
        print(f"   {t} {1e3*ms/len(weights):.1f} us {nbytes/ms/1e9:.2f} TB/s err {err:.1e}")
    sys.stdout.flush()


def chosen():
    """Each shape's chosen tiling (draftline.backends.cuda.matvec.choose_tiling) against cuBLAS."""
    from draftline.backends.cuda.matvec import choose_tiling
    for name, (n, k) in SHAPES.items():
        gated, weights = name == "gate_up", shape_weights(name, n, k)
        for m in (1, 16):
            sweep(name, weights, m, [choose_tiling(m, n // 2 if gated else n, k, gated)], gated)
        del weights
        torch.cuda.empty_cache()


def main():
    if "--chosen" in sys.argv:
        return chosen()
    if "--profile" in sys.argv:
        at = sys.argv.index("--profile")
        dump = sys.argv[sys.argv.index("--dump") + 1] if "--dump" in sys.argv else None
        return profile_round(sys.argv[at + 1], int(sys.argv[at + 2]), dump)
    rows = [Tiling(bn, bk, sp, 4, st) for bn, bk, sp, st in itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (3, 5))]
    rows += [Tiling(128, 64, 1, 4, 4), Tiling(128, 128, 1, 8, 4)]
    for name, (n, k) in SHAPES.items():
        gated, weights = name == "gate_up", shape_weights(name, n, k)
        for m in (1, 16):
            sweep(name, weights, m, [t for t in rows if t.split == 1 or not gated], gated)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
