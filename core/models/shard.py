"""A target's shard for tensor parallelism (Megatron's split, as vLLM and SGLang run it).

Rank r of S holds heads r*Hq/S .. (r+1)*Hq/S - 1 of q and of k/v (KV heads split across ranks),
rows r*I/S .. of gate/up (column-parallel), and the matching input columns of o_proj and
down_proj (row-parallel): each rank's o_proj and down_proj give a partial sum that an
all-reduce completes, so every rank holds the whole residual stream after each block. Norms,
the embedding and the LM head are replicated (the LM head's all-gather would cost more than its
replication saves at the vocabularies served here). The forward is the model's own: ShardedOps
adds the all-reduce after the row-parallel linears it names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .config import ConfigError, ModelConfig
from .eager import EagerOps
from .ops import Forward, Partial
from .target import TargetModel


@dataclass(frozen=True)
class Shard:
    """This process's place: rank of size, and the process group its all-reduces run on."""

    rank: int
    size: int
    group: object = None  # torch.distributed ProcessGroup (None: the default group)


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """A ConfigError naming the fix where the target's heads or MLP width do not split evenly."""
    for name, value in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % size:
            raise ConfigError(f"model.tensor_parallel_size {size}: the target's {name} ({value}) do not divide by it; "
                              f"use a size that divides {cfg.num_heads} heads and {cfg.num_kv_heads} KV heads")
    if cfg.fp8 is not None:
        raise ConfigError("model.tensor_parallel_size > 1 with an fp8 target: its 128-wide weight blocks are not "
                          "split yet; use the bf16 checkpoint or tensor_parallel_size: 1")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    check_divisible(cfg, size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                               intermediate_size=cfg.intermediate_size // size)


COLUMN_PARALLEL = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.")  # output rows split (and bias)
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")  # input columns split


def take(name: str, src, shape: list[int], shard: Shard) -> Tensor:
    """This rank's part of tensor ``name`` of ``shape``: ``src`` a tensor or a safetensors slice
    (read as sliced: a rank never holds the whole tensor)."""
    r, s = shard.rank, shard.size
    if any(p in name for p in COLUMN_PARALLEL):
        n = shape[0] // s
        return src[r * n:(r + 1) * n]
    if any(p in name for p in ROW_PARALLEL):
        n = shape[-1] // s
        return src[:, r * n:(r + 1) * n]
    if name.endswith(("o_proj.bias", "down_proj.bias")) and r:
        return torch.zeros_like(src[:])  # the all-reduce adds rank 0's once
    return src[:]  # norms, embedding, LM head: replicated


class ShardedTarget(TargetModel):
    """A target's shard: TargetModel with this rank's head counts and MLP width, its ``config``
    the whole model's (what drafters and the engine read), and the row-parallel modules whose
    outputs ShardedOps all-reduces."""

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__(local_config(cfg, shard.size))
        self.config, self.shard = cfg, shard
        self.reduced = frozenset(id(m) for layer in self.model.layers for m in (layer.self_attn.o_proj,
                                                                                    layer.mlp.down_proj))

    @classmethod
    def from_whole(cls, full: TargetModel, shard: Shard) -> "ShardedTarget":
        """The shard of a target built whole (a random-init preset: the same draws as one rank's)."""
        model = cls(full.config, shard)
        model.load_state_dict({n: take(n, t, list(t.shape), shard).clone() for n, t in full.state_dict().items()})
        return model.eval()


def shard_reader(shard: Shard):
    """load_weights' reader for a shard: this rank's slice of each tensor, read as sliced."""
    def read(f, name: str) -> Tensor:
        part = f.get_slice(name)
        return take(name, part, part.get_shape(), shard)

    return read


class ShardedOps(EagerOps):
    """Eager operations over a shard: the row-parallel linears' partial sums all-reduced."""

    def __init__(self, reduced: frozenset[int], group: object = None):
        self.reduced, self.group = reduced, group

    def linear(self, fwd: Forward, x: Tensor, module: nn.Linear) -> Partial:
        y = module(x)
        if id(module) in self.reduced:
            dist.all_reduce(y, group=self.group)
        return y

    def gather_heads(self, t: Tensor) -> Tensor:
        """A shard's cached keys or values [Hkv/S, T, D] -> every rank's, in head order [Hkv, T, D]
        (a drafter that reads the target's KV runs whole on every rank)."""
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)


def ops_for(target: TargetModel, default):
    """The eager operations a target runs on: ShardedOps for a shard, else ``default``."""
    if isinstance(target, ShardedTarget):
        return ShardedOps(target.reduced, target.shard.group)
    return default
