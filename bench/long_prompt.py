"""A long prompt prefilled in chunks while short requests stream, in the engine alone (no HTTP):
each step's wall time while the long prompt's chunks run, against the median step, and the
Triton compilations on the way (none should happen after start-up).

`python bench/long_prompt.py [SPEC] [--long=4096] [--backend=cuda] [--no-prefix-caching]` (a CUDA
machine; default the 8B-shaped random DFlash pair, a context of the long prompt and 512 more,
256-token chunks, 32 slots). Three trials, each with 24 new 128-token prompts (160 new tokens
each) and, from the 30th step, one new long prompt (one new token). Beside `draftline bench-serve --long-prompt`, this says whether a stall the
served run shows comes from the engine and the device, or from the serving process around them."""
from __future__ import annotations

import sys
import time

import triton

from draftline.core import benchmark
from draftline.core.engine import Engine
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec

COMPILED: list[str] = []  # Triton kernels compiled, by name


def _hook(*args, **kwargs) -> bool:
    fn = kwargs.get("fn")
    COMPILED.append(getattr(fn, "name", str(fn)))
    return False


def _engine(path: str, backend: str, context: int, prefix_caching: bool) -> Engine:
    data = load_spec(path).model_dump(mode="python")
    data["backend"], data["model"]["max_model_len"] = backend, context
    data["model"]["device"] = "cuda" if backend == "cuda" else "cpu"
    data["server"].update(max_batch_size=32, max_num_batched_tokens=256, enable_prefix_caching=prefix_caching)
    return Engine(type(load_spec(path)).model_validate(data), draft_policy="always")


def _trial(engine: Engine, seed: int, length: int) -> list[tuple[float, float, int]]:
    """(step wall s, its waits for results s, the long prompt's prefilled position) per step."""
    vocab, clock = engine.target.config.vocab_size, engine.machine.clock
    for p in benchmark.random_prompts(vocab, 24, 128, seed=10 + seed):
        engine.add_request(p, SamplingParams(max_new_tokens=160, ignore_eos=True))
    long, steps = None, []
    while engine.scheduler.has_work():
        if long is None and len(steps) == 30:
            prompt = benchmark.random_prompts(vocab, 1, length, seed=100 + seed)[0]
            long = engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        start, waited = time.perf_counter(), clock.wait_s
        engine.step()
        steps.append((time.perf_counter() - start, clock.wait_s - waited, long.prefilled if long else -1))
    return steps


def _option(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    length, backend = int(_option("long", "4096")), _option("backend", "cuda")
    triton.knobs.runtime.jit_post_compile_hook = _hook
    begin = time.perf_counter()
    engine = _engine(args[0] if args else "specs/qwen3-8b-random-dflash.yaml", backend, length + 512,
                     "--no-prefix-caching" not in sys.argv)
    print(f"engine up in {time.perf_counter() - begin:.1f} s ({len(COMPILED)} compilations)")
    for trial in range(3):
        COMPILED.clear()
        steps = _trial(engine, trial, length)
        median = sorted(s[0] for s in steps)[len(steps) // 2]
        during = [s for s in steps if 0 <= s[2] < length]
        chunks = [s for s in steps if 0 <= s[2]][: len(during) + 3]  # its chunks' steps, and the few after
        worst = max(chunks, key=lambda s: s[0])
        print(f"trial {trial}: {len(steps)} steps, median {1e3 * median:.1f} ms; the long prompt's steps: "
              f"{' '.join(f'{1e3 * s[0]:.0f}' for s in chunks)} ms; the worst {worst[0] / median:.2f}x the median "
              f"(its waits {1e3 * worst[1]:.1f} ms); compilations {len(COMPILED)} {COMPILED[:6]}")


if __name__ == "__main__":
    main()
