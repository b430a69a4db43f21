"""`draftline bench-serve`'s workloads: input-id prompts, a shared prefix, a long prompt halfway
through a level, and the options it refuses before loading anything."""

import json

import pytest

from draftline.api.bench import Options, check, run_bench, workload
from draftline.core.models.config import ConfigError
from conftest import tiny_spec

SPEC = tiny_spec(max_model_len=256)


def test_input_id_prompts_share_exactly_the_prefix_and_are_reproducible():
    opts = Options([2, 4], requests=0, max_new=4, prompt_len=8, shared_prefix=16, long_prompt=40)
    prompts, long = workload(opts, vocab=512)
    assert len(prompts) == 2 + opts.count(2) + opts.count(4) == 50  # the warm-up's, then each level's own
    assert [(s.start, s.stop) for s in opts.slices()] == [(0, 2), (2, 18), (18, 50)]
    assert all(len(p) == 24 and p[:16] == prompts[0][:16] for p in prompts)
    assert len({tuple(p[16:]) for p in prompts}) == len(prompts)  # the rest is each prompt's own
    assert all(0 <= t < 512 for p in prompts + [long] for t in p) and len(long) == 40
    assert workload(opts, vocab=512) == (prompts, long)
    text, none = workload(Options([1]), vocab=512)
    assert none is None and all(isinstance(p, str) for p in text)


@pytest.mark.parametrize("opts, needle", [
    (Options([1], shared_prefix=8), "--shared-prefix needs --prompt-len"),
    (Options([1], acceptance="dflash-paper"), "--acceptance needs --prompt-len"),
    (Options([1], prompt_len=200, max_new=64), "does not fit max_model_len 256"),
    (Options([1], prompt_len=8, long_prompt=300), "raise --max-model-len"),
    (Options([1], trace="/no/such/folder/trace"), "its folder does not exist"),
])
def test_workloads_that_cannot_run_are_refused_up_front(opts, needle):
    with pytest.raises(ConfigError, match=needle):
        check(opts, SPEC)
    check(Options([1], prompt_len=200, max_new=64, max_model_len=512), SPEC)  # the override makes room


def test_simulated_acceptance_needs_the_cuda_backend():
    with pytest.raises(ConfigError, match="cuda backend"):
        run_bench(SPEC, Options([1], prompt_len=8, acceptance="0.8"), as_json=True)
    with pytest.raises(ConfigError, match="rate in"):
        run_bench(SPEC, Options([1], prompt_len=8, acceptance="2"), as_json=True)


def test_levels_report_ttft_gaps_and_the_long_prompt_through_http():
    opts = Options([1, 2], requests=4, max_new=6, prompt_len=8, shared_prefix=16, long_prompt=64,
                   modes=("always", "off"))
    rows = json.loads(run_bench(SPEC, opts, as_json=True))
    assert [(r["drafting"], r["concurrency"]) for r in rows] == [("always", 1), ("always", 2), ("off", 1), ("off", 2)]
    for r in rows:
        assert r["requests"] == 4 and r["out_tok_per_s"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0
        assert r["long_ttft_ms"] > 0 and r["gap_ratio"] >= 1.0 and r["long_gap_ratio"] >= 0.0
    assert all(r["tau"] == 1.0 for r in rows if r["drafting"] == "off")  # no request drafted
    assert all(r["cached_share"] > 0 for r in rows)  # the shared 16-token prefix is a cached block
    off = Options([1], requests=2, max_new=2, prompt_len=8, shared_prefix=16, modes=("off",), prefix_caching=False,
                  batched_tokens=8)  # and every prompt in chunks
    assert json.loads(run_bench(SPEC, off, as_json=True))[0]["cached_share"] == 0.0
    table = run_bench(SPEC, Options([1], requests=2, max_new=8, modes=("auto",)), as_json=False)
    assert "TTFT ms" in table and "gap x" in table and "long TTFT" not in table
    assert "auto after concurrency 1: batch 1: width " in table  # what the policy measured and chose, per width


def test_a_small_kv_pool_preempts_through_http_and_every_request_completes():
    """Four streams in a pool of 12 blocks of 16 tokens: all four are admitted (3 blocks each
    with their lookahead), and as they grow the newest are preempted and resumed; every
    request still streams its 24 tokens, and the level reports the preemptions."""
    opts = Options([4], requests=8, max_new=24, prompt_len=16, modes=("always",), kv_blocks=12)
    row = json.loads(run_bench(SPEC, opts, as_json=True))[0]
    assert row["requests"] == 8 and row["out_tok_per_s"] > 0 and row["preemptions"] > 0
    assert json.loads(run_bench(SPEC, Options([4], requests=8, max_new=24, prompt_len=16, modes=("always",)),
                                as_json=True))[0]["preemptions"] == 0


def test_the_long_prompts_gaps_are_those_its_prefill_overlaps():
    """The long-prompt measure: a running request's gaps that overlap the long prompt's prefill
    window, over that request's own median gap; gaps outside the window do not count."""
    from draftline.api.load import prefill_gaps

    steady = {"arrivals": [0.0, 1.0, 2.0, 3.0, 4.0, 9.0, 10.0], "gaps": [1.0, 1.0, 1.0, 1.0, 5.0, 1.0]}
    late = {"arrivals": [0.0, 1.0, 2.0, 3.5, 4.5], "gaps": [1.0, 1.0, 1.5, 1.0]}
    assert prefill_gaps([steady, late], {"start": 2.2, "arrivals": [3.2]}) == 1.5  # steady's 5 s gap lies after
    assert prefill_gaps([steady, late], {"start": 4.5, "arrivals": [8.0]}) == 5.0


def test_chunks_read_together_arrive_once():
    """A client that falls behind reads several streamed chunks at once: they count as one
    arrival (and as merged), never as gaps of microseconds that would make the stream's median
    gap tiny and its worst gap look like a stall of hundreds of steps."""
    import asyncio

    import httpx

    from draftline.api.load import one

    def event(n: int) -> bytes:
        meta = {"completion_tokens": n, "spec_accept_length": 1.0, "prompt_tokens": 3, "cached_tokens": 0}
        return f"data: {json.dumps({'output_ids': list(range(n)), 'meta_info': meta})}\n\n".encode()

    reads = [event(1), event(2) + event(3) + event(4)[:20], event(4)[20:], event(5) + b"data: [DONE]\n\n"]

    async def body():
        for piece in reads:
            await asyncio.sleep(0.01)
            yield piece

    async def run() -> dict:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await one(client, "x", 5, False)

    got = asyncio.run(run())
    assert (len(got["arrivals"]), got["events"], got["merged"], got["tokens"]) == (4, 5, 1, 5)
    assert min(got["gaps"]) > 0.005  # each gap is a read's, not two events' of one read


def test_the_round_trace_says_where_each_level_went(tmp_path):
    """--trace-rounds: every collected round (rows, width, wall and host time; the reference
    backend times no device) and prefill, each level's start marked; bench/trace_rounds.py reads it."""
    import sys
    from pathlib import Path

    rows = json.loads(run_bench(SPEC, Options([1, 2], requests=4, max_new=6, prompt_len=20, modes=("always",),
                                              trace=str(tmp_path / "t")), as_json=True))
    assert [r["cached_share"] for r in rows] == [0.0, 0.0]  # each level's prompts its own: no cache hit
    records = [json.loads(line) for line in (tmp_path / "t.always.jsonl").read_text().splitlines()]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from trace_rounds import levels, summary
    split = levels(records)
    assert [level for level, _, _ in split] == [1, 2]
    assert all("worst_gap" not in r for r in rows)  # the clients' clock is the trace's business, not the table's
    for _, _, recs in split:  # 4 requests of 6 tokens a level: each one's first from its prefill
        gaps = [r["worst_gap"] for r in recs if "worst_gap" in r]  # the worst stream's longest gap, on the trace's clock
        assert len(gaps) == 1 and gaps[0][0] < gaps[0][1] and gaps[0][2] > 0
        assert recs[0]["t"] < gaps[0][1] <= max(r["t"] for r in recs)
        recs = [r for r in recs if "worst_gap" not in r]
        rounds = [r for r in recs if not r["prefill"]]
        assert all(r["width"] > 1 and r["device_s"] is None and r["device_at"] is None and r["wall_s"] > 0 for r in rounds)
        assert sum(r["emitted"] for r in rounds) == 4 * 5 and sum(r["rows"] for r in recs if r["prefill"]) == 4
        prefills = [r for r in recs if r["prefill"]]  # each with its launch's host time and the prompts' progress
        assert all(r["launch_s"] > 0 and len(r["prefilled"]) == r["rows"] for r in prefills)
        assert sorted(p for r in prefills for p in r["prefilled"]) == [20] * 4  # whole 20-token prompts
    lines = [line for level, start, recs in split for line in summary(level, start, recs)]
    assert lines[0].startswith("level 1:") and any(line.startswith("level 2:") for line in lines)
    assert sum("the worst stream gap" in line for line in lines) == 2


def test_the_trace_timeline_shows_the_device_idle_between_launches():
    """bench/trace_rounds.py's timeline: launches in device order, each one's idle gap before it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from trace_rounds import timeline

    def rec(prefill, device_at, device_s, launched):
        return {"prefill": prefill, "rows": 2, "width": 4, "prefilled": [64, 64], "device_at": device_at,
                "device_s": device_s, "launched": launched}

    recs = [rec(False, 1.000, 0.010, 5.0), rec(True, 1.010, 0.012, 5.01), rec(False, 1.122, 0.010, 5.12)]
    lines = timeline(recs, 1)
    assert len(lines) == 4 and "prefill 2 rows to [64, 64]" in lines[2]
    assert lines[3].split("gap")[1].split()[0] == "100.0"  # 1.022 -> 1.122 idle on the device
    assert "host   120.0 device   122.0-  132.0" in lines[3]
    assert timeline([{**r, "device_at": None} for r in recs], 1) == []  # the reference backend times no device
    recs[2]["held"] = 3  # rows the length rule kept out of that step's round
    assert timeline(recs, 1)[3].endswith("round 2 rows width 4, 3 held back")


def _tracked_engines(monkeypatch) -> list:
    """Weak references to every engine bench-serve builds."""
    import weakref

    from draftline.api import bench

    made = []

    class Tracked(bench.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(bench, "Engine", Tracked)
    return made


def test_each_modes_engine_is_gone_once_its_server_stops(monkeypatch):
    """bench-serve runs its modes one after another in one process: once a mode's server stops,
    nothing holds its engine (FastAPI caches each route's endpoint process-wide, so a route
    must not close over the engine), and its memory goes back before the next mode's."""
    import gc

    made = _tracked_engines(monkeypatch)
    run_bench(SPEC, Options([1], requests=2, max_new=4, prompt_len=8, modes=("always", "off")), as_json=True)
    gc.collect()
    assert len(made) == 2 and [r() for r in made] == [None, None]


@pytest.mark.gpu
def test_every_mode_on_the_gpu_gives_back_what_it_took(monkeypatch):
    """The same on the cuda backend: device memory after the three modes is what it was before.
    PyTorch keeps a cuBLAS workspace for each stream that ran a library product (a prefill's),
    process-wide until cleared, whoever made the stream: not an engine's memory, cleared here."""
    import gc

    import torch

    from draftline.core.spec import load_spec

    spec = load_spec("specs/gpu-dflash.yaml")
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    made = _tracked_engines(monkeypatch)
    run_bench(spec, Options([1], requests=2, max_new=8, prompt_len=16), as_json=True)
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    assert len(made) == 3 and all(r() is None for r in made)
    assert torch.cuda.memory_allocated() - before < 2**20
