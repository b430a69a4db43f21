"""Drafter training by self-distillation: the target writes the text the drafter learns from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..methods.dflash import BlockBatch, expected_accept_length, training_loss
from ..models.checkpoint import save_checkpoint
from ..models.config import dflash_config
from ..models.dflash import DFlashDraftModel
from ..models.layers import init_random
from ..models.presets import DRAFT_PRESETS
from ..models.target import TargetModel
from ..sampling import SamplingBatch, SamplingParams, Stream, probs_from_logits, sample
from .loop import Summary, autocast, cosine_lr, log, progress, set_lr
from .pretrain import random_windows


class DenseCache:
    """KV cache for a batch of equal-length rows (generation for distillation only)."""

    def __init__(self, num_layers: int):
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)


@torch.no_grad()
def generate(target: TargetModel, prompts: Tensor, new_tokens: int, temperature: float, seed: int) -> Tensor:
    """prompts [N, P] -> [N, P + new_tokens]; sampling keyed by (seed + row, position)."""
    n, p = prompts.shape
    dev = prompts.device
    cache = DenseCache(target.config.num_layers)
    batch = SamplingBatch.of([SamplingParams(temperature=temperature, seed=seed + i) for i in range(n)], dev)
    seqs, ids = prompts, prompts
    positions = torch.arange(p, device=dev)[None].expand(n, -1)
    for _ in range(new_tokens):
        with autocast(dev):
            hidden, _ = target(ids, positions, cache)
        probs = probs_from_logits(target.logits(hidden[:, -1]), batch)
        ids = sample(probs, batch.seed, positions[:, -1] + 1, Stream.SAMPLE)[:, None]
        positions = positions[:, -1:] + 1
        seqs = torch.cat([seqs, ids], dim=1)
    return seqs


@dataclass(frozen=True)
class DistillConfig:
    preset: str = "tiny-code-dflash"
    num_sequences: int = 4096
    prompt_len: int = 64
    gen_len: int = 192
    gen_batch: int = 1024
    steps: int = 3000
    batch_size: int = 32
    anchors: int = 32
    lr: float = 1e-3
    warmup: int = 100
    gamma: float = 7.0
    seed: int = 0
    eval_every: int = 500
    max_seconds: float | None = None  # stop early (then evaluate and save) past this wall time


def prompt_windows(stream: Tensor, ends: Tensor | None, count: int, length: int, gen: torch.Generator) -> Tensor:
    """`count` windows of `length` tokens: ending where a function body starts, when known."""
    if ends is None or ends.numel() == 0:
        return random_windows(stream, count, length - 1, gen)
    ends = ends[ends >= length]
    pick = ends[torch.randint(0, ends.numel(), (count,), generator=gen)]
    return torch.stack([stream[e - length + 1 : e + 1] for e in pick.tolist()]).long()


def distill_data(target: TargetModel, stream: Tensor, ends: Tensor | None, cfg: DistillConfig, count: int,
                 seed: int, device) -> Tensor:
    """Target continuations of corpus windows (half ending at a function start): three
    batches in four greedy, as temperature-0 serving sees them, one sampled at temperature 1."""
    gen = torch.Generator().manual_seed(seed)
    batches = max(1, count // cfg.gen_batch)
    out = []
    bar = progress(batches, "generate")
    for i in range(batches):
        prompts = prompt_windows(stream, ends if i % 2 == 0 else None, cfg.gen_batch, cfg.prompt_len, gen)
        temperature = 1.0 if i % 4 == 3 else 0.0
        out.append(generate(target, prompts.to(device), cfg.gen_len, temperature, seed * 100003 + i * cfg.gen_batch))
        bar.update(1)
    bar.close()
    return torch.cat(out)


def sample_blocks(data: Tensor, cfg: DistillConfig, blk: int, gen: torch.Generator) -> BlockBatch:
    rows = torch.randint(0, data.shape[0], (cfg.batch_size,), generator=gen)
    lo, hi = cfg.prompt_len - 1, data.shape[1] - blk  # blocks start at the last prompt token or later
    anchors = torch.randint(lo, hi + 1, (cfg.batch_size, cfg.anchors), generator=gen)
    return BlockBatch(tokens=data[rows], anchors=anchors.to(data.device))


@torch.no_grad()
def evaluate(drafter, target, data: Tensor, cfg: DistillConfig, mask_id: int, blk: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1234)
    losses, taus = [], []
    for _ in range(8):
        with autocast(data.device):
            loss, correct = training_loss(drafter, target, sample_blocks(data, cfg, blk, gen), mask_id, cfg.gamma)
        losses.append(float(loss))
        taus.append(expected_accept_length(correct))
    return {"heldout_loss": sum(losses) / len(losses), "heldout_tau_est": sum(taus) / len(taus)}


def train_dflash(target: TargetModel, corpus: dict, out: Path, cfg: DistillConfig, device) -> Summary:
    """``corpus`` as written by build_corpus: token streams and function-start positions."""
    raw = {**DRAFT_PRESETS[cfg.preset], "vocab_size": target.config.vocab_size}
    drafter = DFlashDraftModel(dflash_config(raw))
    init_random(drafter, cfg.seed, drafter.config.layers.initializer_range)
    drafter.to(device).train()
    target.to(device).eval().requires_grad_(False)
    mask_id, blk = drafter.config.mask_token_id, drafter.config.block_size
    log.info("distill.generate", sequences=cfg.num_sequences, tokens=cfg.num_sequences * (cfg.prompt_len + cfg.gen_len))
    train_ends, held_ends = corpus.get("train_function_starts"), corpus.get("heldout_function_starts")
    data = distill_data(target, corpus["train"], train_ends, cfg, cfg.num_sequences, cfg.seed, device)
    held = distill_data(target, corpus["heldout"], held_ends, cfg, cfg.num_sequences // 8, cfg.seed + 1, device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    summary = Summary("dflash")
    bar = progress(cfg.steps, "dflash")
    for step in range(cfg.steps):
        set_lr(opt, cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, summary.time_fraction(cfg.max_seconds)))
        with autocast(device):
            loss, _ = training_loss(drafter, target, sample_blocks(data, cfg, blk, gen), mask_id, cfg.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        summary.steps, summary.loss = step + 1, loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{summary.loss:.3f}", refresh=False)
        out_of_time = cfg.max_seconds is not None and summary.wall_s > cfg.max_seconds
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps or out_of_time:
            drafter.eval()
            summary.heldout = evaluate(drafter, target, held, cfg, mask_id, blk)
            drafter.train()
            log.info("distill.eval", step=step + 1, loss=round(summary.loss, 4), **{k: round(v, 4) for k, v in summary.heldout.items()})
        if out_of_time:
            log.info("distill.time_budget_reached", step=step + 1, max_seconds=cfg.max_seconds)
            break
    bar.close()
    drafter.eval()
    save_checkpoint(out, {**raw, "torch_dtype": "bfloat16"}, drafter.to(torch.bfloat16))
    log.info("distill.done", summary=summary.report(), out=str(out))
    return summary
