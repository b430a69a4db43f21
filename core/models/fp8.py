"""Block-scaled FP8 linear weights, as Qwen's and DeepSeek's `fp8` checkpoints ship them.

A quantized linear's ``weight`` is float8 e4m3 [out, in] and ``weight_scale_inv`` float32
[ceil(out / 128), ceil(in / 128)]: the weight is ``weight * weight_scale_inv`` block by block.
Activations are quantized at run time (``activation_scheme: dynamic``) per token in groups of
128 inputs, each group's scale its largest magnitude over e4m3's largest value, as vLLM and
SGLang run these checkpoints. The math here is the definition every faster product is held to:
both sides dequantized in float32, their products summed in float64 and rounded once, the result
in the input's dtype. The float64 sum makes a row's value independent of the rows beside it
(float32 sums round by the order a matrix routine picks for the shape), which matters more here
than for bf16: the next layer's e4m3 rounding turns a last-bit difference into a step of 1/16,
and a verify window would then compute other tokens than plain decoding.
Norms, embeddings and the LM head stay in the checkpoint's bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .config import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero group's scale (its values quantize to 0 whatever it is)
QUANT_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size"}


@dataclass(frozen=True)
class Fp8Scheme:
    block: tuple[int, int] = (128, 128)  # a weight scale's [rows, columns]; activations group by block[1]


def fp8_scheme(raw: dict[str, Any] | None) -> Fp8Scheme | None:
    """config.json's ``quantization_config`` -> its scheme (None: not quantized); anything but
    block-scaled e4m3 with dynamic activations is refused by name."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("config.json quantization_config: not an object; remove it for a bf16 checkpoint")
    method = raw.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"config.json quantization_config.quant_method {method!r}: only 'fp8' (block-scaled "
                          "e4m3, as Qwen3-*-FP8 ships) loads; use the bf16 checkpoint")
    unknown = sorted(set(raw) - QUANT_KEYS)
    if unknown:
        raise ConfigError(f"config.json quantization_config: unknown key(s) {', '.join(unknown)}; "
                          f"an fp8 checkpoint has {', '.join(sorted(QUANT_KEYS))}")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config.json quantization_config.fmt {raw['fmt']!r}: only e4m3 loads")
    if raw.get("activation_scheme") != "dynamic":
        raise ConfigError(f"config.json quantization_config.activation_scheme {raw.get('activation_scheme')!r}: "
                          "only 'dynamic' (per-token groups quantized at run time) loads")
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"config.json quantization_config.weight_block_size {block!r}: give [rows, columns], "
                          "e.g. [128, 128]; per-tensor fp8 scales do not load")
    return Fp8Scheme(block=(block[0], block[1]))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _e4m3(groups: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Float32 groups -> (e4m3 values, each group's scale, kept as size-1 ``dims``): the scale
    is the group's largest magnitude over e4m3's largest value."""
    scale = (groups.abs().amax(dim=dims, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _spread(scale: Tensor, size: int, dim: int, n: int) -> Tensor:
    """A scale per group of ``size`` along ``dim`` -> one per element of the first ``n``."""
    return scale.repeat_interleave(size, dim).narrow(dim, 0, n)


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """weight [out, in] e4m3, scale_inv [ceil(out / b0), ceil(in / b1)] -> float32 [out, in]."""
    rows, cols = weight.shape
    return weight.float() * _spread(_spread(scale_inv.float(), block[0], 0, rows), block[1], 1, cols)


def quantize_activations(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x [..., in] -> (e4m3 values [..., in], float32 scales [..., ceil(in / group)]), a scale per
    token and group of ``group`` inputs (the last group may be short)."""
    n = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, _cdiv(n, group) * group - n))
    q, scale = _e4m3(padded.unflatten(-1, (-1, group)), (-1,))  # [..., G, group], [..., G, 1]
    return q.flatten(-2)[..., :n], scale[..., 0]


def fp8_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """x [..., in] through the block-scaled weight -> [..., out] in x's dtype (the reference)."""
    q, scale = quantize_activations(x, block[1])
    xs = q.float() * _spread(scale, block[1], -1, x.shape[-1])
    return (xs.double() @ dequantize(weight, scale_inv, block).double().T).to(x.dtype)


def quantize_weight(w: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """A float weight [out, in] -> (e4m3 [out, in], float32 scale_inv [blocks]): each block's
    scale its largest magnitude over e4m3's largest value."""
    rows, cols = w.shape
    b0, b1 = block
    padded = torch.nn.functional.pad(w.float(), (0, _cdiv(cols, b1) * b1 - cols, 0, _cdiv(rows, b0) * b0 - rows))
    q, scale = _e4m3(padded.unflatten(0, (-1, b0)).unflatten(2, (-1, b1)), (1, 3))  # [R, b0, C, b1], [R, 1, C, 1]
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale[:, 0, :, 0]


class Fp8Linear(nn.Module):
    """A linear layer over a block-scaled e4m3 weight (no bias). Its tensors are buffers that
    follow the module's device but never its dtype: a cast to bf16 would round the scales."""

    checkpoint_buffers = ("weight", "weight_scale_inv")  # read from the checkpoint like parameters

    def __init__(self, in_features: int, out_features: int, scheme: Fp8Scheme):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, scheme.block
        blocks = (_cdiv(out_features, scheme.block[0]), _cdiv(in_features, scheme.block[1]))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8))
        self.register_buffer("weight_scale_inv", torch.ones(blocks, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block)

    def _apply(self, fn, recurse=True):
        device = fn(torch.empty(0, device=self.weight.device)).device  # where the module goes
        for name in self.checkpoint_buffers:  # built on the meta device: storage, filled later
            t = getattr(self, name)
            setattr(self, name, torch.empty_like(t, device=device) if t.is_meta else t.to(device))
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, block={self.block}"


def linear(in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme | None) -> nn.Module:
    """A decoder layer's projection: block-scaled FP8 where the checkpoint is quantized."""
    return nn.Linear(in_features, out_features, bias=bias) if scheme is None else Fp8Linear(in_features, out_features, scheme)


# A Qwen3 / Llama decoder layer's projections: what an fp8 checkpoint quantizes
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def quantize_folder(src, dst, block: tuple[int, int] = (128, 128)) -> dict[str, int]:
    """A bf16 HF-format target folder -> the same model as an fp8 checkpoint in ``dst``, in the
    format Qwen3-*-FP8 ships: each decoder projection in e4m3 with its ``weight_scale_inv``
    beside it, ``quantization_config`` in config.json, everything else (and the tokenizer
    files) as it was -> the tensors quantized and kept."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from .checkpoint import tensor_files
    from .config import read_config_json

    src, dst = Path(src), Path(dst)
    raw = read_config_json(src)
    if "quantization_config" in raw:
        raise ConfigError(f"{src}/config.json: already quantized ({raw['quantization_config'].get('quant_method')})")
    tensors: dict[str, Tensor] = {}
    for path in sorted(set(tensor_files(src).values())):
        tensors.update(load_file(str(path)))
    out, quantized = {}, 0
    for name, t in tensors.items():
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(PROJECTIONS):
            out[name], out[f"{name}_scale_inv"] = quantize_weight(t, block)
            quantized += 1
        else:
            out[name] = t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    scheme = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps({**raw, "quantization_config": scheme}, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return {"quantized": quantized, "kept": len(tensors) - quantized}
