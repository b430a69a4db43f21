"""Where start-up's GPU memory goes with server.gpu_memory_utilization: the weights, the KV pool
the sizing chose, the eager warm-ups' and the graphs' reservations, beside the workspace the
sizing set aside (backends/cuda/memory.py).

    python3 bench/memory_probe.py SPEC UTILIZATION MAX_BATCH [MAX_MODEL_LEN]
"""

import json
import sys

import torch

from draftline.core.engine import Engine
from draftline.core.spec import load_spec

GIB = float(1 << 30)


def main(path: str, utilization: float, max_batch: int, max_len: int = 0) -> None:
    spec = load_spec(path)
    server = spec.server.model_copy(update={"gpu_memory_utilization": utilization, "max_batch_size": max_batch})
    model = spec.model.model_copy(update={"max_model_len": max_len}) if max_len else spec.model
    engine = Engine(spec.model_copy(update={"server": server, "model": model}))
    backend = engine.backend
    weights = sum(p.numel() * p.element_size() for m in (engine.target, getattr(backend.drafter, "model", None))
                  if m is not None for p in m.parameters())
    kv = backend.cache.data.numel() * backend.cache.data.element_size()  # the target's keys and values
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({"weights_gib": round(weights / GIB, 2), "target_kv_gib": round(kv / GIB, 2),
                      "budget": backend.kv_budget.summary() if backend.kv_budget else None,
                      "startup": engine.startup, "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 2),
                      "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 2),
                      "device_used_gib": round((total - free) / GIB, 2), "total_gib": round(total / GIB, 2)}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), *(int(a) for a in sys.argv[4:]))
