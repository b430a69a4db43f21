"""Attention splits on a CUDA machine: attention and its combine over 36 distinct layers'
caches of a Qwen3-8B geometry (8 kv heads, 32 query heads, D 128, 4096-key caches), replayed
from one graph, for the split plan the backend picks (draftline.backends.cuda.attention.split_plan), the
same plan merged the other way (by the last split, or by a combine kernel), and fixed splits
of 64 to 512 keys. `python bench/attention_sweep.py` prints µs a layer."""
import dataclasses

import torch

from draftline.backends.cuda.attention import Splits, attend, split_plan
from draftline.backends.cuda.pages import Pages
from draftline.core.benchmark import graphed, median_ms

dev = torch.device("cuda")
LAYERS, HKV, HQ, D, MAX_LEN = 36, 8, 32, 128, 4096
CASES = [(1, 1, 512, True), (1, 16, 512, True), (1, 16, 512, False), (1, 1, 4000, True), (4, 16, 512, True),
         (16, 16, 512, True), (16, 1, 512, True), (16, 16, 4000, True)]  # (rows, new tokens, context, causal)


def layer_us(q, ks, vs, slots, kv_len, causal, splits):
    tickets = torch.zeros(q.shape[0] * HKV, dtype=torch.int32, device=q.device)  # kept zero by the kernel
    pages = Pages.of(ks[0], None)  # each cache its own pages, made once (not inside the graph)
    return 1e3 * median_ms(graphed(lambda: [attend(q, k, v, slots, kv_len, causal, splits, tickets=tickets,
                                                    pages=pages) for k, v in zip(ks, vs)]), 10) / len(ks)


def main():
    for rows, width, context, causal in CASES:
        ks = [torch.randn(rows, HKV, MAX_LEN, D, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
        vs = [torch.randn(rows, HKV, MAX_LEN, D, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
        q = torch.randn(rows, HQ, width, D, dtype=torch.bfloat16, device=dev)
        slots = torch.arange(rows, dtype=torch.int32, device=dev)
        kv_len = torch.full((rows,), context + width, dtype=torch.int32, device=dev)
        plan = split_plan(MAX_LEN, rows, HKV)
        other = dataclasses.replace(plan, merge=not plan.merge)
        name = {True: "merged", False: "combine kernel"}
        cells = [f"plan {plan.count}x>={plan.least}, {name[plan.merge]}: "
                 f"{layer_us(q, ks, vs, slots, kv_len, causal, plan):.2f}",
                 f"{name[other.merge]}: {layer_us(q, ks, vs, slots, kv_len, causal, other):.2f}"]
        for keys in (64, 128, 256, 512):
            fixed = Splits(MAX_LEN // keys, keys)  # every split exactly `keys` long
            cells.append(f"{keys}: {layer_us(q, ks, vs, slots, kv_len, causal, fixed):.2f}")
        print(f"rows {rows} W {width} keys {context + width} causal {causal} | " + " | ".join(cells) + " us/layer")
        del ks, vs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
