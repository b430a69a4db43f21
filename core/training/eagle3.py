"""EAGLE-3 head training by self-distillation: the unrolled training-time test over text the
target wrote (draftline.core.methods.eagle3.training_loss), run by chain.distill_chain."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..methods.eagle3 import training_loss
from ..models.config import read_config_json
from ..models.eagle3 import PRESETS, Eagle3DraftModel, eagle3_config, keep_own_embedding, load_eagle3
from ..models.layers import init_random
from ..models.presets import lookup_preset
from ..models.target import TargetModel
from .chain import ChainTrainConfig, distill_chain
from .loop import Summary


@dataclass(frozen=True)
class Eagle3TrainConfig(ChainTrainConfig):
    preset: str = "tiny-code-eagle3"
    ttt_steps: int = 7  # chained steps unrolled per training position


def chain_tau(correct: Tensor) -> float:
    """τ if every position started a round of len(correct) chained drafts: correct [steps, b, T]
    (step j's agreement at t belongs to the chain started at t - j), bool for greedy drafts, or
    each step's chance of acceptance (sampled drafts' overlaps)."""
    steps, _, t = correct.shape
    starts = torch.arange(t - steps + 1, device=correct.device)
    runs = torch.stack([correct[j][:, starts + j] for j in range(steps)], dim=-1)  # [b, starts, steps]
    return 1.0 + float(runs.float().cumprod(dim=-1).sum(-1).mean())


def stored(weight: Tensor) -> Tensor:
    """bfloat16 when that is exact (the load then finds the target's own values: the head keeps no
    embedding of its own), else as it is."""
    low = weight.detach().to(torch.bfloat16)
    return low if torch.equal(low.to(weight.dtype), weight) else weight.detach()


def train_eagle3(target: TargetModel, corpus: dict | None, out: Path, cfg: Eagle3TrainConfig, device,
                 init: Path | None = None, resume: dict | None = None) -> Summary:
    """``corpus`` as written by build_corpus; ``init`` continues from a head checkpoint;
    ``resume`` (a training state from load_state, ``init`` its folder) continues that run."""
    if init is not None:
        raw, model = read_config_json(init), load_eagle3(init).float()
        keep_own_embedding(model, target)  # the target's copy written beside the weights: read, not trained
    else:
        raw = {**lookup_preset(PRESETS, cfg.preset, "eagle3"), "vocab_size": target.config.vocab_size,
               "draft_vocab_size": target.config.vocab_size}  # the full vocabulary: identity d2t
        model = Eagle3DraftModel(eagle3_config(raw))
        init_random(model, cfg.seed, model.config.layer.initializer_range)
        model.d2t.zero_()
        model.t2d.fill_(True)
    def objective(tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return training_loss(model, target, tokens, cfg.ttt_steps)

    def beside() -> dict[str, Tensor]:
        """Tensors written beside the weights: the target's embedding (the head reads it), as
        speculators' own heads carry it: its from_pretrained does not fill a missing embedding
        from the target and would draft from a random one; and the draft vocabulary's
        map, for a reduced vocabulary only (a full one's is the identity, and speculators'
        Eagle3DraftModel then has no d2t / t2d: it reports them as unexpected keys)."""
        own = model.embed_tokens is not None  # then written with the weights
        tensors = {} if own else {"embed_tokens.weight": stored(target.model.embed_tokens.weight)}
        if model.config.draft_vocab_size < model.config.layer.vocab_size:
            tensors.update(d2t=model.d2t, t2d=model.t2d)
        return tensors

    return distill_chain("eagle3", model, raw, objective, chain_tau, target, corpus, out, cfg, device,
                         extra=beside, resume=resume)
