"""What a GPU user gets with the shipped trained pair: `Engine.generate` on prompts the engine
has not seen, each method against `none` in the same process, greedy, 128 new tokens.

`python bench/user_speedup.py [--batches 1,16] [--depths 2] [--prompts N] [--tokens 128]
[--feed static|continuous] [--policy always|auto] [--plain] [--admission-wait N]
[--num-speculative-tokens K] [--json-schema FILE]` (CUDA machine; without one the cuda backend runs in Triton's
interpreter, which checks only that the tool runs). Every (method, batch) pass takes prompts no
pass before it ran, then runs them again: the first pass shows what one-time costs are left on
the request path, the second the steady state. Triton compilations after start-up are counted
(none should happen).

--feed static: one `generate` call per ``batch`` prompts, so a batch runs until its slowest
request ends. --feed continuous: one call with every prompt, the engine's max_batch_size set
to ``batch``, so a finished request's slot takes the next prompt (what a server does).

--json-schema FILE: every request's output held to that JSON schema (structured outputs; `none`
too), each ending where its grammar does; `none` free of the grammar then runs each prompt to the
length its constrained output had: what the grammar costs at the same tokens."""

from __future__ import annotations

import argparse
import time

import torch

from draftline.core.benchmark import SHIPPED, cuda_spec, idle_ms, interpret_without_gpu, synchronize
from draftline.core.engine import Engine
from draftline.core.grammar import Constraint
from draftline.core.sampling import SamplingParams
from draftline.core.training.corpus import read_prompts

COMPILES = [0]
REPORTING = [False]  # name the kernels compiled on the request path (not start-up's)


def _count_compiles() -> None:
    try:
        import triton

        def hook(*args, **kwargs):
            COMPILES[0] += 1
            fn = kwargs.get("fn")
            if REPORTING[0]:
                print(f"  compiled {getattr(fn, 'name', fn)}: {str(kwargs.get('repr', ''))[:400]}", flush=True)
            return False

        triton.knobs.runtime.jit_post_compile_hook = hook
    except Exception as exc:  # an older Triton: no hook, no count
        print(f"(no compile hook: {exc!r})")
        COMPILES[0] = -1


def _cuda(path: str, depth: int, max_batch: int, plain: bool = False, admission_wait: int = 0, k: int = 0):
    spec = cuda_spec(path, max_batch, depth, **({"batch_invariant": False} if plain else {}))
    data = spec.model_dump(mode="python")
    if k:
        data["speculative"]["num_speculative_tokens"] = k
    data["server"]["admission_wait"] = admission_wait
    return type(spec).model_validate(data)


def _run(engine: Engine, prompts: list[str], batch: int, params: SamplingParams | list[SamplingParams],
         lengths: list[int] | None = None) -> tuple[float, int, float, float, float, tuple[float, float, float]]:
    """(seconds, tokens, tau, tail, drafted, where) over the prompts in generate calls of
    ``batch`` prompts (``params`` one for all or one a prompt; each output's length appended to
    ``lengths`` when given). tail: each call's slowest request's rounds over its mean request's,
    averaged (a static batch runs as long as its slowest request; `none` always reads 1).
    drafted: the share of rounds that drafted (the draft policy may run plain ones). where:
    (host us a round outside prefills, host us a prefill, GPU idle us a round: the gaps between
    rounds on the stream, prefills' device time included)."""
    clock, timeline = engine.machine.clock, []
    engine.backend.timeline = timeline
    step0, wait0, pre0, pres0, rounds0 = clock.step_s, clock.wait_s, clock.prefill_s, clock.prefills, clock.rounds
    synchronize()
    start, tokens, rounds, round_tokens, tails, drafted = time.perf_counter(), 0, 0, 0, [], 0
    for i in range(0, len(prompts), batch):
        counts = []
        for c in engine.generate(prompts[i : i + batch], params[i : i + batch] if isinstance(params, list) else params):
            tokens += len(c.output_ids)
            if lengths is not None:
                lengths.append(len(c.output_ids))
            counts.append(c.meta_info["spec_verify_ct"])
            drafted += c.meta_info["spec_drafted_rounds"]
            round_tokens += c.meta_info["completion_tokens"] - 1
        rounds += sum(counts)
        tails.append(max(counts) * len(counts) / max(1, sum(counts)))
    synchronize()
    seconds = time.perf_counter() - start
    engine.backend.timeline = None
    batch_rounds, prefill_s = clock.rounds - rounds0, clock.prefill_s - pre0
    host = (clock.step_s - step0) - (clock.wait_s - wait0) - prefill_s
    busy = sum(begin.elapsed_time(end) for begin, end in timeline)  # ms inside the rounds' spans
    where = (1e6 * host / max(1, batch_rounds), 1e6 * prefill_s / max(1, clock.prefills - pres0),
             1e3 * idle_ms(timeline) / max(1, batch_rounds), 1e3 * busy / max(1, batch_rounds),
             1e6 * seconds / max(1, batch_rounds), rounds / max(1, batch_rounds), batch_rounds, clock.prefills - pres0)
    return (seconds, tokens, round_tokens / max(1, rounds), sum(tails) / len(tails), drafted / max(1, rounds),
            where)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--depths", default="2")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per (method, batch) pass")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    ap.add_argument("--methods", default="dflash,eagle3,gemma4_mtp")
    ap.add_argument("--feed", choices=["static", "continuous"], default="static")
    ap.add_argument("--policy", default="always", help="draft policy: always (the method itself) or auto")
    ap.add_argument("--plain", action="store_true", help="model.batch_invariant: false (default: the spec's, on)")
    ap.add_argument("--admission-wait", type=int, default=0,
                    help="server.admission_wait: steps a free slot may wait to be filled together with others")
    ap.add_argument("--num-speculative-tokens", type=int, default=0, help="K for every method (default: the spec's)")
    ap.add_argument("--json-schema", help="hold every output to this JSON schema file (structured outputs)")
    args = ap.parse_args()
    schema = None if args.json_schema is None else Constraint("json_schema", open(args.json_schema).read())
    interpret_without_gpu()
    _count_compiles()
    pool = read_prompts("specs/tiny/eval_prompts.jsonl")
    batches, cursor, rows = [int(b) for b in args.batches.split(",")], 0, []
    for depth in (int(d) for d in args.depths.split(",")):
        for name in args.methods.split(","):
            slots = [max(batches)] if args.feed == "static" else batches  # one engine, or one per batch size
            for size in slots:
                engine = Engine(_cuda(SHIPPED[name], depth, size, args.plain, args.admission_wait,
                                      args.num_speculative_tokens),
                                draft_policy=args.policy)
                base = engine.with_method({"method": "none"})
                print(f"{name} depth {depth} slots {size}: start-up {engine.startup}, none {base.startup}", flush=True)
                for batch in batches if args.feed == "static" else [size]:
                    prompts = [pool[(cursor + i) % len(pool)] for i in range(max(batch, args.prompts))]
                    cursor += len(prompts)
                    rows += _passes(name, depth, batch, engine, base, prompts,
                                    batch if args.feed == "static" else len(prompts), args.tokens, schema)
                clock = engine.machine.clock
                print(f"  host work {clock.host_us_per_round:.0f} us/round over {clock.rounds} rounds", flush=True)
                for arm in engine.policy.table() if args.policy == "auto" else []:  # what auto estimated
                    print(f"  policy bucket {arm['batch_bucket']:>2} width {arm['width']:>2} "
                          f"{arm['ms_per_token']} ms/token over {arm['rounds']} rounds, chosen {arm['chosen']}")
                del engine, base
                torch.cuda.empty_cache()
    print(f"{'method':<11}{'depth':>6}{'batch':>6}{'prompts':>8}{'tau':>6}{'tok/s':>9}{'none':>9}{'speedup':>9}"
          f"{'ms/req':>8}{'none':>8}{'compiles':>9}{'tail':>6}{'drafted':>8}{'host us':>8}{'prefill':>8}{'idle us':>8}"
          f"{'none host':>10}{'idle':>6}")
    for r in rows:
        print(f"{r[0]:<11}{r[1]:>6}{r[2]:>6}{r[3]:>8}{r[4]:>6.2f}{r[5]:>9.0f}{r[6]:>9.0f}{r[7]:>8.2f}x"
              f"{r[8]:>8.1f}{r[9]:>8.1f}{r[10]:>9}{r[11]:>6.2f}{r[12]:>8.2f}{r[13][0]:>8.0f}{r[13][1]:>8.0f}"
              f"{r[13][2]:>8.0f}{r[14][0]:>10.0f}{r[14][2]:>6.0f}")
    print("host us: the engine's host work a round outside prefills; prefill: host us a prefill launch; idle us: "
          "GPU time between rounds (prefills' device time included); none: the same for `none`")
    print(f"{'method':<11}{'batch':>6}{'pass':>6}{'rounds':>8}{'rows':>6}{'prefills':>9}{'busy us':>9}{'wall us':>9}"
          f"{'none rounds':>12}{'rows':>6}{'prefills':>9}{'busy us':>9}{'wall us':>9}")
    for r in rows:
        d, n = r[13], r[14]
        print(f"{r[0]:<11}{r[2]:>6}{r[3]:>6}{d[6]:>8}{d[5]:>6.1f}{d[7]:>9}{d[3]:>9.0f}{d[4]:>9.0f}"
              f"{n[6]:>12}{n[5]:>6.1f}{n[7]:>9}{n[3]:>9.0f}{n[4]:>9.0f}")
    print("rounds: launches collected; rows: requests a round; busy us: GPU time inside a round's launch span; "
          "wall us: the pass's wall time over its rounds")


def _passes(name: str, depth: int, batch: int, engine: Engine, base: Engine, prompts: list[str], per_call: int,
            tokens: int, schema: Constraint | None = None) -> list[tuple]:
    """Rows for never-seen prompts, then the same again, each against `none`; with ``schema``
    each output held to it and ending where it does."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=schema is None, constraint=schema)
    compiles, REPORTING[0] = COMPILES[0], True
    first = [_run(engine, prompts, per_call, params)]
    REPORTING[0] = False
    first.append(_run(base, prompts, per_call, params))
    new = COMPILES[0] - compiles if compiles >= 0 else -1
    lengths: list[int] = []
    again = [_run(engine, prompts, per_call, params), _run(base, prompts, per_call, params, lengths)]
    if schema is not None:  # the grammar's cost: `none` free of it, each prompt as many tokens as it gave
        free = _run(base, prompts, per_call,
                    [SamplingParams(max_new_tokens=max(1, n), ignore_eos=True) for n in lengths])
        held, unheld = again[1][1] / again[1][0], free[1] / free[0]
        print(f"  batch {batch}: constrained none {held:.0f} tok/s, none free of the grammar at the same lengths "
              f"{unheld:.0f} tok/s: the grammar keeps {held / unheld:.2f}", flush=True)
    return [(name, depth, batch, label, tau, ns / ts, nb / tb, (ns / ts) / (nb / tb), 1e3 * ts / len(prompts),
             1e3 * tb / len(prompts), new if label == "new" else 0, tail, drafted, where, base_where)
            for label, ((ts, ns, tau, tail, drafted, where), (tb, nb, *_, base_where))
            in (("new", first), ("again", again))]

if __name__ == "__main__":
    main()
