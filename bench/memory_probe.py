"""Where start-up's GPU memory goes with server.gpu_memory_utilization: the weights, the KV pool
the sizing chose, the eager warm-ups' and the graphs' reservations, beside the workspace the
sizing set aside (backends/cuda/memory.py).

    python3 bench/memory_probe.py SPEC UTILIZATION MAX_BATCH [MAX_MODEL_LEN]

It then lists the allocator's segments by (stream, pool): reserved against allocated, and the
live blocks by the line of this project that allocated them.
"""

import json
import sys
from collections import Counter

import torch

from draftline.backends.cuda.memory import weight_bytes
from draftline.core.engine import Engine
from draftline.core.spec import load_spec

GIB = float(1 << 30)


def main(path: str, utilization: float, max_batch: int, max_len: int = 0) -> None:
    spec = load_spec(path)
    server = spec.server.model_copy(update={"gpu_memory_utilization": utilization, "max_batch_size": max_batch})
    model = spec.model.model_copy(update={"max_model_len": max_len}) if max_len else spec.model
    torch.cuda.memory._record_memory_history(max_entries=100000)
    engine = Engine(spec.model_copy(update={"server": server, "model": model}))
    backend = engine.backend
    weights = weight_bytes(engine.target, getattr(backend.drafter, "model", None))
    kv = backend.cache.data.numel() * backend.cache.data.element_size()  # the target's keys and values
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({"weights_gib": round(weights / GIB, 2), "target_kv_gib": round(kv / GIB, 2),
                      "budget": backend.kv_budget.summary() if backend.kv_budget else None,
                      "startup": engine.startup, "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 2),
                      "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 2),
                      "device_used_gib": round((total - free) / GIB, 2), "total_gib": round(total / GIB, 2)}, indent=1))


def segments() -> None:
    """Reserved and allocated GiB by (stream, pool); the largest live allocations by their site."""
    snap = torch.cuda.memory._snapshot()
    groups: dict[tuple, list[float]] = {}
    sites: Counter = Counter()
    for seg in snap["segments"]:
        entry = groups.setdefault((seg["stream"], tuple(seg.get("segment_pool_id", ()))), [0.0, 0.0, 0])
        entry[0] += seg["total_size"] / GIB
        entry[1] += seg["allocated_size"] / GIB
        entry[2] += 1
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                own = [f for f in block.get("frames", []) if "/draftline/" in f["filename"] or "/work/" in f["filename"]]
                where = f"{own[0]['filename'].split('/')[-1]}:{own[0]['line']} {own[0]['name']}" if own else "?"
                sites[where] += block["size"] / GIB
    for (stream, pool), (total, used, count) in sorted(groups.items(), key=lambda g: -g[1][0]):
        print(f"stream {stream} pool {pool}: reserved {total:.2f} GiB, allocated {used:.2f} GiB, {count} segments")
    for where, size in sites.most_common(15):
        print(f"  {size:7.2f} GiB  {where}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), *(int(a) for a in sys.argv[4:]))
    segments()
