"""Where a served level's time went, from `draftline bench-serve --trace-rounds PATH`'s records:
per concurrency level, the share of wall time the device spent on rounds, the prefills, each
verify width's rounds (rows, wall, device and host time, tokens a row), and the host's cycles.

`python bench/trace_rounds.py PATH.MODE.jsonl` (any machine: it reads the file only). A level whose
rounds' wall time runs well past their device time had the GPU idle behind the host; the host
quantiles and the slowest rounds say when.
"""
from __future__ import annotations

import json
import statistics
import sys


def quantiles(values: list[float], qs=(0.5, 0.9, 0.99)) -> str:
    s = sorted(values)
    return " ".join(f"p{int(q * 100)} {1e3 * s[int(q * (len(s) - 1))]:.1f}" for q in qs) if s else "-"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f} ms"


def levels(records: list[dict]) -> list[tuple[int, float, list[dict]]]:
    """(concurrency, its start, its records) in order."""
    marks = [i for i, r in enumerate(records) if "level" in r] or [-1]
    out = []
    for k, m in enumerate(marks):
        end = marks[k + 1] if k + 1 < len(marks) else len(records)
        start = records[m]["t"] if m >= 0 else records[0]["t"]
        out.append((records[m]["level"] if m >= 0 else 0, start, records[m + 1 : end]))
    return out


def summary(level: int, start: float, recs: list[dict]) -> list[str]:
    gaps = [r["worst_gap"] for r in recs if "worst_gap" in r]  # the clients' worst stream gap (later traces)
    recs = [r for r in recs if "worst_gap" not in r]
    rounds = [r for r in recs if not r["prefill"]]
    prefills = [r for r in recs if r["prefill"]]
    if not rounds:
        return [f"level {level}: no rounds"]
    wall = rounds[-1]["t"] - start
    device = sum(r["device_s"] or 0.0 for r in rounds)
    emitted = sum(r["emitted"] for r in rounds)
    idle = sum(max(0.0, r["wall_s"] - (r["device_s"] or r["wall_s"])) for r in rounds)
    lines = [f"level {level}: {wall:.2f} s, {emitted / wall:.0f} tok/s; {len(rounds)} rounds, device busy on rounds "
             f"{device / wall:.0%} of the wall; {len(prefills)} prefills (rows {statistics.mean([p['rows'] for p in prefills]) if prefills else 0:.1f} "
             f"each); rounds' wall past their device time {idle:.2f} s",
             f"  host cycle ms: {quantiles([r['host_s'] for r in rounds if r['host_s'] is not None], (0.5, 0.75, 0.9, 0.99))}"]
    held = [r["held"] for r in rounds if r.get("held")]  # rows the length rule kept out of a step's round (later traces)
    if held:
        lines.append(f"  rows held back by their rounds in flight (Stops.done_in_flight): {sum(held)} in {len(held)} "
                     f"rounds, against {sum(r['rows'] for r in rounds)} rows launched")
    launches = [p["launch_s"] for p in prefills if "launch_s" in p]  # traces from before it lack the field
    if launches:
        slow = max(prefills, key=lambda p: p.get("launch_s", 0.0))
        lines.append(f"  prefill launch ms: {quantiles(launches, (0.5, 0.9, 1.0))}; the slowest: {slow['rows']} rows "
                     f"to positions {slow['prefilled'][:4]}, wall {1e3 * slow['wall_s']:.1f} ms")
    timed = [p for p in prefills if p.get("device_s") is not None]  # the cuda backend's, from later traces
    if timed:
        late = max(prefills, key=lambda p: p["wall_s"])
        lines.append(f"  prefill device ms: {quantiles([p['device_s'] for p in timed], (0.5, 0.9, 1.0))}; the longest "
                     f"wait for one: {late['rows']} rows to positions {late['prefilled'][:4]}, wall "
                     f"{1e3 * late['wall_s']:.1f} ms, device {_ms(late.get('device_s'))}, launch {_ms(late.get('launch_s'))}")
        lines += timeline(recs, recs.index(late))
    for begin, end, typical in gaps:
        after = next((i for i, r in enumerate(recs) if r["t"] >= end), len(recs) - 1)  # the collect that ended it
        lines.append(f"  the worst stream gap: {1e3 * (end - begin):.1f} ms against its median {1e3 * typical:.1f} ms, "
                     f"{begin - start:.3f} s into the level")
        lines += timeline(recs, after)
    for width in sorted({r["width"] for r in rounds}):
        rs = [r for r in rounds if r["width"] == width]
        dev = [r["device_s"] for r in rs if r["device_s"] is not None]
        lines.append(f"  width {width:>2}: {len(rs):>4} rounds, rows p50 {statistics.median(r['rows'] for r in rs):>5}, "
                     f"wall ms {quantiles([r['wall_s'] for r in rs], (0.5, 0.9))}, device ms {quantiles(dev, (0.5, 0.9))}, "
                     f"tokens a row {sum(r['emitted'] for r in rs) / sum(r['rows'] for r in rs):.2f}")
    return lines


def timeline(recs: list[dict], at: int, before: int = 6, after: int = 3) -> list[str]:
    """The launches around record ``at`` in device order: when the host launched each, when the
    device began and ended it, and the device's idle gap before it (traces with device_at only).
    Host and device times are ms from the window's first launch on each clock."""
    window = sorted((r for r in recs[max(0, at - before) : at + after + 1] if r.get("device_at") is not None),
                    key=lambda r: r["device_at"])
    if not window:
        return []
    host0, dev0, busy = window[0]["launched"], window[0]["device_at"], None
    lines = ["  around it, in device order (ms; host: launch returned, device: start-end, gap: device idle before):"]
    for r in window:
        start, end = r["device_at"] - dev0, r["device_at"] + r["device_s"] - dev0
        gap = "" if busy is None else f" gap {1e3 * (start - busy):7.1f}"
        what = f"prefill {r['rows']} rows to {r['prefilled'][:2]}" if r["prefill"] else \
            f"round {r['rows']} rows width {r['width']}" + (f", {r['held']} held back" if r.get("held") else "")
        lines.append(f"    host {1e3 * (r['launched'] - host0):7.1f} device {1e3 * start:7.1f}-{1e3 * end:7.1f}{gap}  {what}")
        busy = end if busy is None else max(busy, end)
    return lines


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/trace_rounds.py PATH.MODE.jsonl (from bench-serve --trace-rounds PATH)")
    with open(sys.argv[1]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for level, start, recs in levels(records):
        print("\n".join(summary(level, start, recs)))


if __name__ == "__main__":
    main()
