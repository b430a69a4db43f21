"""`draftline bench`: GPU time per round and per output token against the bandwidth floor.

The floor of a round is the bytes it must read (every weight matrix it multiplies with, the
embedding table counting one row per token, plus the KV it attends over) divided by a copy
bandwidth measured in the same run. The DFlash round reads the target, the drafter and the
LM head a second time (the drafter's logits). `--peer hf` times Hugging Face transformers'
static-cache torch.compile decoding of the same weights in the same run.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .engine import Engine
from .models.config import read_config_json
from .models.fp8 import Fp8Linear
from .models.presets import target_preset_raw
from .sampling import SamplingParams
from .spec import Spec, load_spec

# the shipped trained pair, one spec a method (the bench tools' default subjects)
SHIPPED = {"dflash": "specs/tiny-dflash.yaml", "eagle3": "specs/tiny-eagle3.yaml",
           "gemma4_mtp": "specs/tiny-gemma4-mtp.yaml"}


def interpret_without_gpu() -> bool:
    """Whether there is no GPU, in which case the cuda backend runs in Triton's interpreter on
    the CPU (set here, before anything imports Triton): a GPU tool then checks that it runs,
    and its times are the interpreter's, not a GPU's."""
    if torch.cuda.is_available():
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return True


def cuda_spec(path: str | Path, max_batch_size: int, pipeline_depth: int | str = "auto", **model) -> Spec:
    """``path``'s spec on the cuda backend with ``model`` fields overridden and the server's
    slots and depth set; without a GPU, float32 on the CPU (the interpreter runs no half
    precision) with a context of at most 256 positions."""
    spec = load_spec(path)
    data = spec.model_dump(mode="python")
    data["backend"] = "cuda"
    data["model"].update(device="cuda", **model)
    if not torch.cuda.is_available():
        data["model"].update(device="cpu", dtype="float32", max_model_len=min(data["model"]["max_model_len"], 256))
    data["server"].update(max_batch_size=max_batch_size, pipeline_depth=pipeline_depth)
    return type(spec).model_validate(data)


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()  # random data, never zeros
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src), repeats) / 1e3)


def median_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matrix_bytes(module: nn.Module) -> int:
    """Bytes of the module's weights a forward multiplies with (embedding tables excluded), as
    stored: an FP8 projection's e4m3 weight and its block scales."""
    seen, total = set(), 0
    quantized = [(f"{name}.{b}", getattr(m, b)) for name, m in module.named_modules() if isinstance(m, Fp8Linear)
                 for b in Fp8Linear.checkpoint_buffers]
    for name, p in [*module.named_parameters(), *quantized]:
        if id(p) in seen or "embed_tokens" in name:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True)
class Geometry:
    """What one round of a method reads, in bytes."""

    weights: int  # every weight matrix the round multiplies with
    embed_row: int  # one embedding row
    kv_per_token: int  # KV bytes per cached token per request (target, plus drafter if it owns a cache)
    tokens_in: int  # tokens embedded per request per round

    def bytes(self, batch: int, context: int) -> int:
        return self.weights + batch * (self.tokens_in * self.embed_row + context * self.kv_per_token)


def geometry(engine: Engine) -> Geometry:
    """A chain drafter reads its weights (and the KV it attends over) once per draft step, but
    an EAGLE-3 ``fc`` only once per round; a drafter without an LM head of its own (DFlash, MTP)
    makes its logits through the target's, which is read again for each of its passes."""
    target, plan = engine.target, engine.plan
    cfg = target.config
    elem = next(target.parameters()).element_size()
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    weights = matrix_bytes(target)
    if cfg.tie_word_embeddings:
        weights += target.lm_head.weight.numel() * elem
    tokens = plan.num_speculative_tokens + 1
    drafter = getattr(engine.backend.drafter, "model", None)
    if drafter is not None:
        passes = plan.num_speculative_tokens if plan.drafting == "chain" else 1
        fc = drafter.fc.weight.numel() * elem if hasattr(drafter, "fc") else 0
        head = 0 if hasattr(drafter, "lm_head") else target.lm_head.weight.numel() * elem
        weights += passes * (matrix_bytes(drafter) - fc + head) + fc
        dc = getattr(drafter.config, "layers", None) or drafter.config.layer  # EAGLE-3: its one layer
        kv += passes * 2 * dc.num_layers * dc.num_kv_heads * dc.head_dim * elem  # own cache, or the target's (MTP)
        tokens += plan.block_size or passes
    return Geometry(weights, cfg.hidden_size * elem, kv, tokens)


@dataclass
class Row:
    method: str
    batch: int
    ms_round: float
    tokens_round: float  # tokens emitted per request per round (τ)
    ms_token: float  # per request
    floor_ms: float
    graph_ms: float  # the round's captured graphs replayed back to back: its GPU time
    throughput: float  # output tokens per second, all requests
    idle_ms: float  # per round, the GPU's time outside the rounds' graphs: what the host leaves
    host_us: float = 0.0  # per round, the engine's own host work (its step time less waiting on the device)

    @property
    def ratio(self) -> float:
        return self.ms_round / self.floor_ms


def _prompts(engine: Engine, batch: int, length: int, seed: int) -> list[list[int]]:
    return random_prompts(engine.target.config.vocab_size, batch, length, seed)


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` input-id prompts of ``length`` tokens drawn from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def _decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, int]:
    """Prefill, then time every following round: (seconds, rounds, tokens emitted in them)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.step()  # admits and prefills everything (the batch fits), launches the first rounds
    torch.cuda.synchronize()
    before, start = sum(len(r.output_ids) for r in reqs), time.perf_counter()
    rounds = engine.machine.clock.rounds
    while engine.scheduler.has_work():
        engine.step()
    torch.cuda.synchronize()
    seconds, rounds = time.perf_counter() - start, engine.machine.clock.rounds - rounds
    return seconds, rounds, sum(len(r.output_ids) for r in reqs) - before


def idle_ms(timeline: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    """GPU time between one flight's end and the next one's start on the stream, summed: what
    the rounds' graphs leave (host work the launches wait on, eager copies)."""
    return sum(max(0.0, end.elapsed_time(begin)) for (_, end), (begin, _) in zip(timeline, timeline[1:]))


def graph_ms(engine: Engine, batch: int) -> float:
    """GPU time of one deciding round's graph at this batch (its draft step inside), replayed
    back to back over padding rows."""
    backend, bucket = engine.backend, engine.backend.bucket(batch)
    graphs = [g for key, (g, _) in getattr(backend.graphs, "_graphs", {}).items()
              if key[:4] == ("round", bucket, backend.width, True) and not key[5]]  # argmax drafts
    if not graphs:
        return 0.0
    backend.bufs.load([], bucket)  # padding rows: replays move no request's state
    return median_ms(lambda: [g.replay() for g in graphs], repeats=20)


def bench_method(engine: Engine, batches: list[int], prompt_len: int, new_tokens: int, bandwidth: float
                 ) -> list[Row]:
    geo, rows = geometry(engine), []
    for b in batches:
        prompts = _prompts(engine, b, prompt_len, seed=b)
        _decode(engine, prompts, min(new_tokens, 32))  # warm the kernels and the allocator at this batch
        timeline = engine.backend.timeline = []
        clock = engine.machine.clock
        host0, wait0 = clock.step_s, clock.wait_s
        seconds, rounds, tokens = _decode(engine, prompts, new_tokens)
        host_us = 1e6 * ((clock.step_s - host0) - (clock.wait_s - wait0)) / max(1, rounds)
        engine.backend.timeline = None
        ms_round = 1e3 * seconds / rounds
        floor = 1e3 * geo.bytes(b, prompt_len + new_tokens // 2) / bandwidth
        tau = tokens / (rounds * b)
        rows.append(Row(engine.plan.method, b, ms_round, tau, ms_round / tau, floor, graph_ms(engine, b),
                        tokens / seconds, idle_ms(timeline) / rounds, host_us))
    return rows


@dataclass
class SimRow:
    """One method at one batch under simulated acceptance, against `none` in the same run."""

    method: str
    batch: int
    tau: float  # measured
    tau_profile: float
    ms_round: float
    throughput: float
    speedup: float  # over none's output tokens/s
    predicted: float  # tau x t(none round) / t(this method's round at tau = 1)
    host_us: float
    idle_us: float
    width: int = 0  # the verify width its rounds took
    passes: int = 0  # calibration passes (_own_continuations)
    moved: list[int] = field(default_factory=list)  # rows the last pass still changed: first changed position

    @property
    def efficiency(self) -> float:
        return self.speedup / self.predicted if self.predicted else 0.0


def bench_acceptance(base: Engine, specs: list, batches: list[int], prompt_len: int, new_tokens: int,
                     rate: float, widths: list[int] | None = None) -> list[SimRow]:
    """Per method, verify width and batch: a round at tau = 1 (its own drafts, never accepted on
    random weights), then the same rounds with drafts replaced per draftline.core.simulated,
    against `none`. ``widths``: the verify widths to run (where the backend offers them at a
    batch; None: the full K + 1)."""
    from .simulated import expected_tau

    none = base if base.plan.method == "none" else base.with_method({"method": "none"})
    beyond = min(64, none.spec.model.max_model_len - prompt_len - new_tokens)  # drafts past the last token
    continuations, baseline = {}, {}
    for b in batches:
        continuations |= greedy_continuations(none, _prompts(none, b, prompt_len, seed=b), new_tokens + beyond)
        baseline[b] = bench_method(none, [b], prompt_len, new_tokens, 1.0)[0]
    rows = []
    for speculative in specs:
        engine = base.with_method(speculative)
        k = engine.plan.num_speculative_tokens
        runs = [(w, b) for w in widths or [k + 1] for b in batches if w in engine.backend.verify_widths(b)]
        plain = {}
        for w, b in runs:
            engine.policy.width = w
            plain[w, b] = bench_method(engine, [b], prompt_len, new_tokens, 1.0)[0]
        engine.policy.width = None
        sim = simulate(engine, continuations)
        settled = _own_continuations(engine, sim, batches, prompt_len, new_tokens + beyond, rate)
        for w, b in runs:
            engine.policy.width = w
            r = bench_method(engine, [b], prompt_len, new_tokens, 1.0)[0]
            none_row, one = baseline[b], plain[w, b]
            rows.append(SimRow(r.method, b, r.tokens_round, expected_tau(rate, w - 1), r.ms_round, r.throughput,
                               r.throughput / none_row.throughput, r.tokens_round * none_row.ms_round / one.ms_round,
                               r.host_us, 1e3 * r.idle_ms, w, *settled[b]))
        del engine
        torch.cuda.empty_cache()
    return rows


def greedy_continuations(none: Engine, prompts: list[list[int]], tokens: int) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy continuation of ``tokens`` tokens from a `none` engine, run in
    batches of its max_batch_size: what simulated acceptance replays as drafts."""
    params, out, size = SamplingParams(max_new_tokens=tokens, ignore_eos=True), {}, none.spec.server.max_batch_size
    for i in range(0, len(prompts), size):
        group = prompts[i : i + size]
        out |= {tuple(p): c.output_ids for p, c in zip(group, none.generate(group, params))}
    return out


def simulate(engine: Engine, continuations: dict[tuple[int, ...], list[int]]):
    """Installs simulated acceptance (rate 1 until set_rate) over these continuations in the
    engine's cuda backend, which captures its graphs again with it inside."""
    from .simulated import SimulatedAcceptance

    sim = SimulatedAcceptance(1.0, dict(continuations), engine.spec.server.max_batch_size,
                              engine.backend.cache.max_len, engine.target.config.vocab_size, engine.device)
    engine.backend.set_draft_override(sim)
    return sim


def _own_continuations(engine: Engine, sim, batches: list[int], prompt_len: int, tokens: int, rate: float,
                       passes: int = 8) -> dict[int, tuple[int, list[int]]]:
    """settle() over each batch's prompts -> batch: (passes, first changed positions)."""
    return {b: settle(engine, sim, _prompts(engine, b, prompt_len, seed=b), tokens, rate, passes) for b in batches}


def settle(engine: Engine, sim, prompts: list[list[int]], tokens: int, rate: float, passes: int = 8
           ) -> tuple[int, list[int]]:
    """Makes ``sim``'s continuations of ``prompts`` this method's own greedy output under the
    profile's rounds. In bf16 without the batch-invariant kernels the `none` run's
    continuation is not bit-identical to what a verify window computes (reduction orders
    follow the row count and the window's offset), so replayed verbatim its first near-tied
    argmax is rejected and tau falls to 1. Each pass replays the known continuation and takes
    the method's (lossless) greedy output as the next one, first with every draft kept (rate
    1: most positions settle at once), then at the profile's rate, until a pass changes
    nothing: every position a pass agrees on up to its first change stays agreed, so each pass
    moves that point forward. The measured tau beside the profile's shows any position that
    still moves. -> (passes, the first changed position of each row the last pass still
    changed)."""
    done = (0, [])
    for i, p in enumerate([1.0] * 2 + [rate] * passes):
        sim.set_rate(p)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
        moved = [_first_change(sim.continuations[tuple(q)], o.output_ids) for q, o in zip(prompts, outs)]
        sim.continuations.update({tuple(q): o.output_ids for q, o in zip(prompts, outs)})
        done = (i + 1, [m for m in moved if m is not None])
        if not done[1] and p == rate:
            break
    return done


def _first_change(before: list[int], after: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(before, after)) if x != y), None)


def format_sim(rows: list[SimRow], profile: str) -> str:
    lines = [f"SIMULATED acceptance (--acceptance {profile}): drafts replaced by each row's greedy continuation",
             f"{'method':<11}{'batch':>6}{'width':>6}{'tau':>7}{'profile':>8}{'ms/round':>10}{'tok/s':>9}{'speedup':>9}"
             f"{'predicted':>10}{'effic.':>8}{'host us':>9}{'idle us':>9}  calibration"]
    for r in rows:
        moved = f", {len(r.moved)} rows still moving (from {min(r.moved)})" if r.moved else ", settled"
        lines.append(f"{r.method:<11}{r.batch:>6}{r.width:>6}{r.tau:>7.2f}{r.tau_profile:>8.2f}{r.ms_round:>10.3f}"
                     f"{r.throughput:>9.0f}{r.speedup:>8.2f}x{r.predicted:>9.2f}x{r.efficiency:>8.2f}"
                     f"{r.host_us:>9.0f}{r.idle_us:>9.0f}  {r.passes} passes{moved}")
    return "\n".join(lines)


def hf_peer(engine: Engine, prompt_len: int, new_tokens: int) -> float:
    """ms per token of transformers' greedy decoding with a static cache, which its generate()
    compiles with torch.compile (CUDA graphs for the decode step), batch 1, same weights."""
    import transformers

    m = engine.spec.model
    raw = target_preset_raw(m.random_init.preset) if m.random_init is not None else read_config_json(m.path)
    config = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device(engine.device):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    hf = hf.to(engine.dtype).eval()
    missing, unexpected = hf.load_state_dict(engine.target.state_dict(), strict=False)
    if unexpected or missing:
        raise RuntimeError(f"weights do not map onto transformers' model: missing {missing}, unexpected {unexpected}")
    ids = torch.tensor(_prompts(engine, 1, prompt_len, seed=0), device=engine.device)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(2):
        run(new_tokens)  # compile and capture
    short, full = min(run(8) for _ in range(3)), min(run(new_tokens) for _ in range(3))
    return 1e3 * (full - short) / (new_tokens - 8)


def format_rows(rows: list[Row], bandwidth: float) -> str:
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)",
             f"{'method':<11}{'batch':>6}{'ms/round':>10}{'tok/round':>10}{'ms/token':>10}{'floor ms':>10}"
             f"{'x floor':>9}{'graphs ms':>11}{'idle ms':>9}{'host us':>9}{'tok/s':>9}"]
    for r in rows:
        lines.append(f"{r.method:<11}{r.batch:>6}{r.ms_round:>10.3f}{r.tokens_round:>10.2f}{r.ms_token:>10.3f}"
                     f"{r.floor_ms:>10.3f}{r.ratio:>9.2f}{r.graph_ms:>11.3f}{r.idle_ms:>9.3f}{r.host_us:>9.0f}"
                     f"{r.throughput:>9.0f}")
    return "\n".join(lines)


def graphed(fn):
    """fn captured in a graph (after a warm-up on a side stream) -> its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
