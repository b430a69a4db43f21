"""The EAGLE-3 drafter: one decoder layer fed with fused target features, drafting a chain.

Target hidden states entering a few target layers (by default 2, N/2 and N-3) are
concatenated and projected by ``fc`` to the drafter's width. The single layer ("midlayer")
takes concat(input_norm(embed(token)), hidden_norm(h)) as its attention input (2H wide), with
h as the residual; then the MLP, the final norm and an LM head over a reduced draft
vocabulary, mapped to target ids by ``d2t`` (target id = draft id + d2t[draft id]). A chain
step feeds the layer's pre-norm output back as the next step's h, without ``fc``. The
drafter keeps its own one-layer KV cache; it reads the target's embedding unless its
checkpoint brings one that differs.

Three checkpoint dialects are read (eagle3_config.py): EAGLE / SpecForge
(``LlamaForCausalLMEagle3``; weights ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), AngelSlim (``Eagle3LlamaForCausalLM``, the same weights) and ``speculators``
(``speculators_model_type: eagle3``, the layer's weights under ``layers.0.*``, with its
options: ``input_norm`` or ``fc_norm.i`` before ``fc``, a Qwen3 layer's q/k norms, the normed
output fed back, a sliding-window layer). A checkpoint's ``embed_tokens`` is the head's own
embedding where it differs from the target's (a head trained with its embedding unfrozen).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from .checkpoint import CheckpointError, load_weights, read_tensor, tensor_files, vocab_map
from .config import ModelConfig, read_config_json
from .eagle3_config import DIALECTS, Eagle3Config, default_aux_layer_ids, eagle3_config
from .eager import EAGER
from .layers import MLP, Attention, AttentionFn, DecoderLayer, RMSNorm, Rotary, decoder_layer
from .ops import Forward, Ops
from .presets import lookup_preset

__all__ = ["Eagle3Config", "Eagle3DraftModel", "default_aux_layer_ids", "eagle3_config", "load_eagle3"]


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose q/k/v read [normed embedding, normed hidden] (2H)."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.self_attn = Attention(cfg)
        a = self.self_attn
        a.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=cfg.attention_bias)
        a.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        a.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual


class Eagle3DraftModel(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        lc = cfg.layer
        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, lc.hidden_size, bias=False)
        if cfg.norm_before_fc:  # over the concatenated features [.., taps*H]
            self.input_norm = RMSNorm(cfg.num_aux * cfg.target_hidden_size, lc.rms_norm_eps)
        if cfg.fc_norm:  # one per tapped layer's features
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, lc.rms_norm_eps) for _ in range(cfg.num_aux))
        self.embed_tokens: nn.Embedding | None = None  # the head's own embedding, when it has one (own_embedding)
        self.midlayer = Eagle3Layer(lc, cfg.norm_before_residual)
        # a deeper speculators head: plain decoder layers after the first (cache layers 1, 2, ...)
        self.extra_layers = nn.ModuleList(DecoderLayer(lc) for _ in range(lc.num_layers - 1))
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.lm_head = nn.Linear(lc.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [Vd] offsets
        self.register_buffer("t2d", torch.zeros(lc.vocab_size, dtype=torch.bool))  # [V] in the draft vocab
        self.rotary = Rotary(lc.rope, lc.head_dim)

    def fuse(self, features: Tensor, ops: Ops = EAGER, fwd: Forward | None = None) -> Tensor:
        """Target features [..., taps*H] -> the first step's hidden [..., H]: fc, after the
        checkpoint's feature norms (norm_before_fc: one over all; fc_norm: one per tap), through
        ``ops`` (``fwd``: the forward it feeds, where there is one)."""
        if self.config.norm_before_fc:
            features = ops.norm(fwd, features, self.input_norm)
        if self.config.fc_norm:
            chunks = features.chunk(self.config.num_aux, dim=-1)
            features = torch.cat([ops.norm(fwd, c, norm) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return ops.project(features, self.fc)

    def table(self, target) -> Tensor:
        """The embedding the head reads [V, H]: its own, else the target's."""
        return (target.model.embed_tokens if self.embed_tokens is None else self.embed_tokens).weight

    def embed(self, target, ids: Tensor) -> Tensor:
        """ids [...] -> the head's input embeddings [..., H]."""
        return self.table(target)[ids]

    def own_embedding(self, weight: Tensor | None) -> None:
        """Keep ``weight`` [V, H] as the head's own embedding (None: read the target's)."""
        if weight is None:
            self.embed_tokens = None
            return
        self.embed_tokens = nn.Embedding(*weight.shape, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def next_hidden(self, out: Tensor, normed: Tensor | None = None) -> Tensor:
        """What a chain step feeds the next: the layer's output, or its final norm (norm_output)."""
        if not self.config.norm_output:
            return out
        return self.norm(out) if normed is None else normed

    def readout(self, out: Tensor, normed: Tensor | None = None) -> Tensor:
        """What lm_head reads: the final norm of the layer's output (or the output itself)."""
        if not self.config.readout_norm:
            return out
        return self.norm(out) if normed is None else normed

    def run(self, ops: Ops, fwd: Forward, table: Tensor, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """One drafter forward: tokens [N, W] (rows of ``table``, the embedding the head reads),
        hidden [N, W, H] (fc of the target features, or the previous step's output) at
        fwd.positions -> (the output [N, W, H], its final norm): the chain's next hidden and
        what its readout reads."""
        m = self.midlayer
        x = ops.normed_beside(table, tokens, m.input_layernorm, hidden, m.hidden_norm)  # [N, W, 2H]
        return self._layers(ops, fwd, x, hidden)

    def step(self, embeds: Tensor, hidden: Tensor, positions: Tensor, attn: AttentionFn) -> Tensor:
        """run() in eager PyTorch from embeddings [B, T, H] (training), attending through ``attn``
        -> the output [B, T, H]."""
        m = self.midlayer
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        return self._layers(EAGER, Forward(positions, attn), x, hidden)[0]

    def _layers(self, ops: Ops, fwd: Forward, x: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The layers from the first one's input x = [norm(embeds), norm(hidden)] [N, W, 2H]
        -> (out, norm(out)); each layer's closing add+norm is the next one's input norm (the
        last's: the final norm)."""
        m, width = self.midlayer, hidden.shape[-1]
        closing = [layer.input_layernorm for layer in self.extra_layers] + [self.norm]
        h, pending = decoder_layer(ops, fwd, 0, m, self.rotary, x[..., width:] if m.norm_before_residual else hidden, x)
        out, x = ops.add_norm(fwd, pending, h, closing[0])
        for i, layer in enumerate(self.extra_layers, start=1):  # plain decoder layers on the first's output
            h, pending = decoder_layer(ops, fwd, i, layer, self.rotary, out, x)
            out, x = ops.add_norm(fwd, pending, h, closing[i])
        return out, x

    def greedy(self, ops: Ops, normed: Tensor) -> Tensor:
        """The greedy token over the target vocabulary from what lm_head reads [..., H] (readout()):
        the draft vocabulary's argmax mapped to its target id. Equal to logits().argmax(-1) when
        draft ids are ascending (ties: the first in either order): check ascending_ids() first."""
        best = ops.argmax(self.lm_head, normed)  # [...] draft-vocabulary index
        return best + self.d2t[best]

    def ascending_ids(self) -> bool:
        ids = self.draft_ids()
        return bool((ids[1:] > ids[:-1]).all())

    def logits(self, out: Tensor, normed: Tensor | None = None, ops: Ops = EAGER) -> Tensor:
        """Layer output [..., H] (and its final norm, where made) -> float32 logits over the
        *target* vocabulary [..., V]: the draft vocabulary's logits at their target ids, -inf
        elsewhere (never drafted)."""
        small = ops.logits(self.lm_head, self.readout(out, normed))  # [..., Vd]
        full = small.new_full((*small.shape[:-1], self.config.layer.vocab_size), float("-inf"))
        ids = torch.arange(small.shape[-1], device=small.device) + self.d2t
        return full.index_copy_(-1, ids, small)

    def draft_ids(self) -> Tensor:
        """[Vd] target id of each draft-vocabulary entry."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t


def _names(model: Eagle3DraftModel) -> dict[str, str]:
    """Module parameter name -> checkpoint tensor name for the model's dialect."""
    if model.config.dialect == "speculators":
        def rename(n: str) -> str:
            if n.startswith("extra_layers."):
                i, rest = n.removeprefix("extra_layers.").split(".", 1)
                return f"layers.{int(i) + 1}.{rest}"
            return n.replace("midlayer.", "layers.0.", 1)
        return {n: rename(n) for n, _ in model.named_parameters()}
    return {n: n for n, _ in model.named_parameters()}


def load_eagle3(folder: str | Path) -> Eagle3DraftModel:
    """The head of either dialect; every tensor in the folder is loaded or refused by name."""
    model = Eagle3DraftModel(eagle3_config(read_config_json(folder)))
    unused = set(load_weights(model, folder, names=_names(model)))
    files = tensor_files(folder)
    DIALECTS[model.config.dialect].check_tensors(unused - {"d2t", "t2d", "embed_tokens.weight"}, folder)
    read = {name: read_tensor(files, name) for name in ("d2t", "t2d", "embed_tokens.weight") if name in files}
    vocab_map(model, read.get("d2t"), read.get("t2d"), folder)
    if "embed_tokens.weight" in read:
        emb = read["embed_tokens.weight"]
        want = [model.config.layer.vocab_size, model.config.layer.hidden_size]
        if list(emb.shape) != want:
            raise CheckpointError(f"{folder}: embed_tokens.weight has shape {list(emb.shape)}, "
                                  f"the config implies {want}")
        model.own_embedding(emb.float())  # until compared with the target's (keep_own_embedding)
    return model.eval()


def keep_own_embedding(model: Eagle3DraftModel, target) -> bool:
    """Drop a checkpoint embedding equal to the target's (a frozen copy: the target's is read
    instead); keep one that differs (trained with the head). -> whether the head has its own."""
    if model.embed_tokens is None:
        return False
    theirs = target.model.embed_tokens.weight
    if torch.equal(model.embed_tokens.weight.to(theirs.device, theirs.dtype), theirs):
        model.own_embedding(None)
        return False
    return True


# Random-init shapes, as config.json dictionaries (either dialect parses the same way).
PRESETS: dict[str, dict[str, Any]] = {
    # for the tiny-qwen3 / tiny-llama random targets (6 layers, width 128, byte vocabulary)
    "tiny-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 384, "draft_vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]},  # outputs: the inputs of 1, 3, 4
    },
    # for CI's micro target (2 layers, width 32): every tap is layer 1's input
    "micro-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 4096, "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 0]},
    },
    # for the shipped tiny-code target (8 layers, width 256, 4096-token BPE vocabulary)
    "tiny-code-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 4096, "draft_vocab_size": 4096,
        "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
    },
    # the shape of SpecForge's Qwen3-8B heads (32K draft vocabulary), for GPU benchmarks
    "qwen3-8b-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 151936, "draft_vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "initializer_range": 0.02,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]},  # outputs: the inputs of 2, 18, 33
    },
}


def preset_config(name: str) -> Eagle3Config:
    return eagle3_config(lookup_preset(PRESETS, name, "eagle3"))


def random_eagle3(preset: str, seed: int, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> Eagle3DraftModel:
    """Random weights; the draft vocabulary is the target's first draft_vocab_size ids."""
    from .loader import _materialize

    cfg = preset_config(preset)
    model = _materialize(lambda: Eagle3DraftModel(cfg), seed, cfg.layer.initializer_range, torch.device(device), dtype)
    with torch.no_grad():
        model.d2t.zero_()
        model.t2d.zero_()
        model.t2d[: cfg.draft_vocab_size] = True
    return model
