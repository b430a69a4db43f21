"""Drafter training by self-distillation: the target writes the text the drafter learns from."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..methods.dflash import BlockBatch, expected_accept_length, training_loss
from ..models.checkpoint import save_checkpoint
from ..models.config import dflash_config, read_config_json
from ..models.dflash import DFlashDraftModel
from ..models.layers import init_random
from ..models.loader import load_dflash
from ..models.presets import DRAFT_PRESETS
from ..models.target import TargetModel
from ..sampling import SamplingBatch, SamplingParams, Stream, probs_from_logits, sample
from .loop import Budget, Schedule, Summary, autocast, log, progress, train_loop
from .pretrain import random_windows
from .state import Position, StateWriter, restore


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
class DistillConfig(Schedule):
    preset: str = "tiny-code-dflash"
    num_sequences: int = 4096
    prompt_len: int = 64  # corpus-window prompts; bare prompts keep their own length
    gen_len: int = 192  # every sequence is prompt_len + gen_len tokens long
    gen_batch: int = 1024
    mix: str = "bare,fn,bare,sampled"  # prompt kind of each generation batch, cycled
    warm_tokens: int = 16  # `warm` rows: sampled tokens after a bare prompt, before the greedy part
    anchors: int = 32
    gamma: float = 7.0
    # the loss's share on the target's whole distribution (the rest on its token): drafts
    # sampled from the drafter are accepted as its distribution meets the target's
    soft: float = 0.5


@dataclass(frozen=True)
class Distilled:
    tokens: Tensor  # [N, L] prompt + target continuation
    first_anchor: Tensor  # [N] each row's last prompt position: blocks start there or later


def pack(**parts: Distilled) -> dict[str, Tensor]:
    """Named distilled sets as flat int32 tensors (half of int64's bytes), for a training state."""
    return {f"{name}.{f}": getattr(d, f).int() for name, d in parts.items() for f in ("tokens", "first_anchor")}


def unpack(data: dict[str, Tensor], name: str, device) -> Distilled:
    return Distilled(data[f"{name}.tokens"].long().to(device), data[f"{name}.first_anchor"].long().to(device))


def prompt_windows(stream: Tensor, ends: Tensor | None, count: int, length: int, gen: torch.Generator) -> Tensor:
    """`count` windows of `length` tokens: ending where a function body starts, when known."""
    ends = None if ends is None else ends[ends >= length]
    if ends is None or ends.numel() == 0:
        return random_windows(stream, count, length - 1, gen)
    pick = ends[torch.randint(0, ends.numel(), (count,), generator=gen)]
    return torch.stack([stream[e - length + 1 : e + 1] for e in pick.tolist()]).long()


def bare_prompts(prompts: list[Tensor], count: int, gen: torch.Generator) -> Tensor:
    """`count` function-start prompts of near-equal length (neighbours in length order), cut
    to the shortest so they batch: what serving sees, a signature with nothing before it."""
    order = sorted(prompts, key=len)
    start = int(torch.randint(0, max(1, len(order) - count), (1,), generator=gen))
    chosen = order[start : start + count]
    n = min(len(p) for p in chosen)
    return torch.stack([p[:n] for p in chosen]).long()


def _prompts(kind: str, corpus: dict, split: str, cfg: DistillConfig, count: int, gen: torch.Generator) -> Tensor:
    if kind == "bare" and corpus.get(f"{split}_prompts"):
        return bare_prompts(corpus[f"{split}_prompts"], count, gen)
    ends = corpus.get(f"{split}_function_starts") if kind == "fn" else None
    return prompt_windows(corpus[split], ends, count, cfg.prompt_len, gen)


# Generation may take this share of a run's --max-seconds (the held-out rows are a few more
# batches); the training steps get the rest.
GENERATION_SHARE = 0.4


def distill_data(target: TargetModel, corpus: dict, split: str, cfg: DistillConfig, count: int, seed: int,
                 device, mix: str | None = None, budget: Budget | None = None) -> Distilled:
    """Target continuations, greedy (labels = what temperature-0 verification accepts) except
    for `sampled` batches, which continue random windows at temperature 1, and `hot` ones,
    function starts continued at temperature 1 (what sampled requests meet). `warm` batches
    sample a few tokens after a bare prompt first: on training prompts an overfit target
    recites what it memorised, and the sampled detour shows the drafter the target's own
    greedy habits, which is what it meets on unseen prompts."""
    gen = torch.Generator().manual_seed(seed)
    kinds = (mix or cfg.mix).split(",")
    rows, firsts = [], []
    batch = max(1, min(cfg.gen_batch, count))  # --num-sequences 64 generates 64, not a whole gen_batch
    size = batch if budget is None or budget.max_seconds is None else min(batch, 8)  # budgeted: time a small one first
    bar = progress(count, f"generate {split}")
    done, i, started = 0, 0, time.perf_counter()
    while done < count:
        if i and budget is not None and budget.generation_over(GENERATION_SHARE):
            log.info("distill.generate_budget_reached", split=split, sequences=done, of_sequences=count)
            break
        kind, key = kinds[i % len(kinds)], seed * 100003 + done
        n = min(size, count - done)
        prompts = _prompts("bare" if kind in ("warm", "hot") else kind, corpus, split, cfg, n, gen).to(device)
        if kind == "warm":
            prompts = generate(target, prompts, cfg.warm_tokens, 1.0, key + 7)
        total = cfg.prompt_len + cfg.gen_len
        temperature = 1.0 if kind in ("sampled", "hot") else 0.0
        rows.append(generate(target, prompts, total - prompts.shape[1], temperature, key))
        firsts.append(torch.full((prompts.shape[0],), prompts.shape[1] - 1, device=device))
        done, i = done + n, i + 1
        bar.update(n)
        rate = done / (time.perf_counter() - started)  # sequences per second so far
        if i == 1 and done < count:
            log.info("distill.generate_estimate", split=split, sequences=count, seconds_left=round((count - done) / rate, 1))
        if size < batch:  # each budgeted batch about a tenth of the budget, growing at most 4x
            size = max(1, min(batch, 4 * size, int(rate * 0.1 * budget.max_seconds)))
    bar.close()
    return Distilled(torch.cat(rows), torch.cat(firsts))


def sample_blocks(data: Distilled, cfg: DistillConfig, blk: int, gen: torch.Generator) -> BlockBatch:
    rows = torch.randint(0, data.tokens.shape[0], (cfg.batch_size,), generator=gen).to(data.tokens.device)
    lo = data.first_anchor[rows][:, None].float()  # [b, 1]
    hi = data.tokens.shape[1] - blk
    u = torch.rand(cfg.batch_size, cfg.anchors, generator=gen).to(lo.device)
    anchors = (lo + u * (hi - lo + 1)).long().clamp(max=hi)  # uniform in [first_anchor, L - B]
    return BlockBatch(tokens=data.tokens[rows], anchors=anchors)


@torch.no_grad()
def round_tau(drafter, target, data: Distilled, mask_id: int, blk: int, new_tokens: int,
              budget: Budget | None = None) -> float:
    """τ as the engine measures it at temperature 0 on greedy rows: the first round starts at
    the token prefill emitted, each next one right after the last accepted draft. Anchors sampled uniformly
    overstate τ, since a round tends to start where the previous one failed."""
    tokens, anchors = data.tokens, data.first_anchor + 1  # prefill emits the first token
    end = torch.clamp(anchors + new_tokens, max=tokens.shape[1])  # first position not generated
    emitted = rounds = 0
    while True:
        live = (anchors + blk <= end).nonzero()[:, 0]
        if live.numel() == 0 or (rounds and budget is not None and budget.over()):  # spent: the rounds so far
            return emitted / max(1, rounds)
        with autocast(tokens.device):
            _, correct, _ = training_loss(drafter, target, BlockBatch(tokens[live], anchors[live, None]), mask_id)
        n = correct[:, 0].long().cumprod(dim=-1).sum(-1) + 1  # tokens this round emits
        anchors[live] += n
        emitted, rounds = emitted + int(n.sum()), rounds + live.numel()


@torch.no_grad()
def evaluate(drafter, target, data: Distilled, bare: Distilled, cfg: DistillConfig, mask_id: int,
             blk: int, budget: Budget | None = None) -> dict[str, float]:
    """Held-out loss and τ over 8 fixed batches (fewer once the budget is spent): greedy, and
    with drafts sampled from the drafter at temperature 1 (slot k against the target's
    distribution after the text's own tokens); and greedy τ in rounds."""
    gen = torch.Generator().manual_seed(1234)
    losses, taus, sampled = [], [], []
    for i in range(8):
        if i and budget is not None and budget.over():
            break
        with autocast(data.tokens.device):
            loss, correct, overlap = training_loss(drafter, target, sample_blocks(data, cfg, blk, gen), mask_id,
                                                   cfg.gamma, cfg.soft)
        losses.append(float(loss))
        taus.append(expected_accept_length(correct))
        sampled.append(expected_accept_length(overlap))
    return {"heldout_loss": sum(losses) / len(losses), "heldout_tau_est": sum(taus) / len(taus),
            "heldout_sampled_tau_est": sum(sampled) / len(sampled),
            "heldout_tau_rounds": round_tau(drafter, target, bare, mask_id, blk, new_tokens=128, budget=budget)}


def train_dflash(target: TargetModel, corpus: dict | None, out: Path, cfg: DistillConfig, device,
                 init: Path | None = None, resume: dict | None = None) -> Summary:
    """``corpus`` as written by build_corpus; ``init`` continues from a drafter checkpoint;
    ``resume`` (a training state from load_state, ``init`` its folder) continues that run on its own data."""
    if init is not None:
        raw = read_config_json(init)
        drafter = load_dflash(init).float()
    else:
        raw = {**DRAFT_PRESETS[cfg.preset], "vocab_size": target.config.vocab_size}
        drafter = DFlashDraftModel(dflash_config(raw))
        init_random(drafter, cfg.seed, drafter.config.layers.initializer_range)
    budget = Budget(cfg.max_seconds)
    drafter.to(device)
    target.to(device).eval().requires_grad_(False)
    mask_id, blk = drafter.config.mask_token_id, drafter.config.block_size
    if resume is not None:
        data, held, bare = (unpack(resume["data"], name, device) for name in ("train", "held", "bare"))
    else:
        data, held, bare = _dflash_data(target, corpus, cfg, device, budget)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    start = Position() if resume is None else restore(resume, drafter, opt, gen)
    writer = StateWriter(out, "dflash", cfg, target, pack(train=data, held=held, bare=bare))

    def loss() -> Tensor:
        return training_loss(drafter, target, sample_blocks(data, cfg, blk, gen), mask_id, cfg.gamma, cfg.soft)[0]

    def save(pos: Position) -> None:
        save_checkpoint(out, {**raw, "torch_dtype": "bfloat16"}, drafter, dtype=torch.bfloat16)
        writer.save(pos, drafter, opt, gen)

    summary = train_loop("dflash", drafter, opt, loss, lambda: evaluate(drafter, target, held, bare, cfg, mask_id, blk, budget),
                         cfg, device, save=save, budget=budget, start=start)
    log.info("distill.done", summary=summary.report(), out=str(out))
    return summary


def _dflash_data(target: TargetModel, corpus: dict, cfg: DistillConfig, device,
                 budget: Budget) -> tuple[Distilled, Distilled, Distilled]:
    """The training rows, the held-out rows, and bare held-out function starts for round τ."""
    log.info("distill.generate", sequences=cfg.num_sequences, tokens=cfg.num_sequences * (cfg.prompt_len + cfg.gen_len))
    data = distill_data(target, corpus, "train", cfg, cfg.num_sequences, cfg.seed, device, budget=budget)
    held = distill_data(target, corpus, "heldout", cfg, max(1, cfg.num_sequences // 8), cfg.seed + 1, device,
                        budget=budget)
    # function starts, as `draftline eval` runs them: 256, or fewer in a run of few sequences
    small = replace(cfg, gen_batch=min(cfg.gen_batch, 256, max(8, cfg.num_sequences // 8)))
    bare = distill_data(target, corpus, "heldout", small, small.gen_batch, cfg.seed + 2, device, mix="bare",
                        budget=budget)  # within --max-seconds too: 256 rows took a minute on a CPU
    return data, held, bare
