"""Sampling and lossless acceptance in plain torch: the oracle for the backends' kernels.

Randomness is keyed by (request seed, absolute position, stream), never by batch order or a
generator's state, so a seeded request draws the same numbers alone or in any batch. The
keyed hash uses only 32-bit integer operations so that a kernel can reproduce it bit-exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import numpy
import torch
from torch import Tensor

from .bounds import MAX_SEED, check_params
from .grammar import Constraint

MASK32 = 0xFFFFFFFF
HASH_MUL = (0x7FEB352D, 0x846CA68B)  # hash32's two multipliers (lowbias32), in each of its forms


class Stream(IntEnum):
    """Independent random streams at one (seed, position)."""

    SAMPLE = 1  # plain sampling: the prefill token, the bonus token, `none` decoding
    ACCEPT = 2  # the uniform of the accept/reject test
    RESIDUAL = 3  # resampling from max(0, p - q) after a rejection
    DRAFT = 4  # a drafter sampling its own tokens (draft_sample_method: probabilistic)


@dataclass(frozen=True)
class SamplingParams:
    """One request's resolved parameters (draftline.core.options.SamplingOptions is the user-facing,
    validated form; its docs say what each field does)."""

    temperature: float = 0.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    max_new_tokens: int | None = 128  # None: the rest of the context, resolved per request
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings
    min_new_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    logprobs: int | None = None  # top alternatives to report per output token; None: none
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    constraint: "Constraint | None" = None  # structured output the tokens must match (core/grammar.py)

    def __post_init__(self) -> None:
        check_params(self.__dict__)  # the spec's bounds: NaN, a negative temperature, top_p > 1 are refused

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def features(self) -> set[str]:
        """What a backend must offer to run this request (Backend.features): "penalties"
        (presence / frequency / repetition penalties, logit_bias, min_new_tokens), "logprobs",
        "prompt_logprobs", "structured" (a constraint)."""
        need = {"penalties"} if self.adjusts_logits else set()
        return need | ({"logprobs"} if self.logprobs is not None else set()) | (
            {"prompt_logprobs"} if self.prompt_logprobs is not None else set()) | (
            {"structured"} if self.constraint is not None else set())

    @functools.cached_property
    def reads_logits(self) -> bool:
        """Whether a round must hand this request's logits to the host-side acceptance
        (filtering, adjusting, masking or reporting them) rather than deciding it inside the graph."""
        return self.reads_logits_beyond_masks or self.constraint is not None

    @functools.cached_property
    def reads_logits_beyond_masks(self) -> bool:
        """reads_logits for anything but a constraint, whose token masks a graph can apply."""
        return self.top_k > 0 or self.top_p < 1 or self.adjusts_logits or self.logprobs is not None

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits are changed before sampling (draftline.core.penalties) for this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_new_tokens)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors (one row per request)."""

    temperature: Tensor  # [N] float32
    top_k: Tensor  # [N] int64, <= 0 means off
    top_p: Tensor  # [N] float32
    seed: Tensor  # [N] int64

    @staticmethod
    def of(params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> "SamplingBatch":
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seed=torch.tensor([p.seed for p in params], dtype=torch.int64, device=device),
        )


# ---------------------------------------------------------------- keyed randomness


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow (split c into 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer (lowbias32 constants); x int64 holding values in [0, 2^32)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, HASH_MUL[0])
    x = x ^ (x >> 15)
    x = _mul32(x, HASH_MUL[1])
    return x ^ (x >> 16)


def row_key(seed: Tensor, position: Tensor, stream: int) -> Tensor:
    """seed, position [N] int64 -> 32-bit key [N] int64 (on the CPU through numpy, as uniform;
    a few keys in Python's integers, where numpy's per-call cost is most of the work)."""
    if seed.device.type == "cpu" and position.device.type == "cpu":
        seed, position = numpy.broadcast_arrays(seed.numpy(), position.numpy())
        if seed.size <= SMALL_KEYS:
            keys = [_key_int(int(s), int(p), int(stream)) for s, p in zip(seed.flat, position.flat)]
            return torch.tensor(keys, dtype=torch.int64).reshape(seed.shape)
        k = _hash32_host(_hash32_host(seed.astype(numpy.uint32)) ^ (seed >> 32).astype(numpy.uint32))
        k = _hash32_host(k ^ position.astype(numpy.uint32))
        return torch.from_numpy(_hash32_host(k ^ numpy.uint32(int(stream))).astype(numpy.int64))
    k = hash32(hash32(seed & MASK32) ^ ((seed >> 32) & MASK32))
    k = hash32(k ^ (position & MASK32))
    return hash32(k ^ int(stream))


def uniform(key: Tensor, cols: int | None = None) -> Tensor:
    """Uniform floats in (0, 1) from keys [N]: [N], or [N, cols] (one per column) when cols given.
    On the CPU through numpy's uint32 arithmetic, which wraps as the hash needs (the int64
    form's masked 16-bit multiplies cost far more there per element), the same bits."""
    if key.device.type == "cpu":
        return torch.from_numpy(_uniform_host(key.numpy(), cols))
    if cols is not None:
        key = hash32(key[:, None] ^ column_keys(cols, key.device)[None, :])
    return unit_interval(hash32(key))


def _uniform_host(key: numpy.ndarray, cols: int | None) -> numpy.ndarray:
    """uniform's numbers for int64 keys in [0, 2^32), in numpy uint32: float32 [N] or [N, cols]."""
    h = key.astype(numpy.uint32)
    if cols is not None:
        h = _hash32_host(h[:, None] ^ _column_keys_host(cols)[None, :])
    h = _hash32_host(h)
    return ((h >> numpy.uint32(9)).astype(numpy.float32) + numpy.float32(0.5)) * numpy.float32(1.0 / 8388608.0)


SMALL_KEYS = 16  # keys a CPU call hashes in Python's integers


def _hash32_int(x: int) -> int:
    """hash32 on one Python integer in [0, 2^32)."""
    x ^= x >> 16
    x = (x * HASH_MUL[0]) & MASK32
    x ^= x >> 15
    x = (x * HASH_MUL[1]) & MASK32
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=4096)
def _seed_int(seed: int) -> int:
    """A seed's part of every key it makes (a request's seed recurs each round)."""
    return _hash32_int(_hash32_int(seed & MASK32) ^ ((seed >> 32) & MASK32))


def _key_int(seed: int, position: int, stream: int) -> int:
    return _hash32_int(_hash32_int(_seed_int(seed) ^ (position & MASK32)) ^ stream)


def _hash32_host(x: numpy.ndarray) -> numpy.ndarray:
    """hash32 on uint32 values (products wrap modulo 2^32), in place where it can."""
    x = x ^ (x >> numpy.uint32(16))
    x *= numpy.uint32(HASH_MUL[0])
    x ^= x >> numpy.uint32(15)
    x *= numpy.uint32(HASH_MUL[1])
    x ^= x >> numpy.uint32(16)
    return x


@functools.lru_cache(maxsize=8)
def _column_keys_host(cols: int) -> numpy.ndarray:
    return column_keys(cols, torch.device("cpu")).numpy().astype(numpy.uint32)


@functools.lru_cache(maxsize=8)
def column_keys(cols: int, device: torch.device) -> Tensor:
    """Each column's own hash [cols], the same for every row and draw: made once per width."""
    return hash32(torch.arange(cols, dtype=torch.int64, device=device) + 0x9E3779B9)


def unit_interval(h: Tensor) -> Tensor:
    """32-bit hashes -> float32 strictly inside (0, 1): 23 bits plus one half, scaled by 2^-23.

    Every value (k + 0.5) / 2^23 is exact in float32, so neither 0 nor 1 can occur; 24 bits
    would round the top value to 1.0 and make Gumbel noise infinite.
    """
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


# ---------------------------------------------------------------- distributions


@dataclass(frozen=True)
class Filters:
    """Which passes a batch needs (every row greedy; any row with top-k; any with top-p), known
    on the host from the requests' parameters: read off device tensors, each is a wait for
    the device, which drains a backend's rounds in flight."""

    greedy: bool
    top_k: bool
    top_p: bool

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> "Filters":
        """As SamplingBatch's float32 values compare (a top_p a hair under 1 rounds to 1 there)."""
        return Filters(all(numpy.float32(p.temperature) == 0 for p in params), any(p.top_k > 0 for p in params),
                       any(numpy.float32(p.top_p) < 1 for p in params))


def probs_from_logits(logits: Tensor, batch: SamplingBatch, filters: Filters | None = None) -> Tensor:
    """logits [N, ..., V] -> float32 probabilities after temperature, top-k and top-p.

    Greedy rows (temperature 0) become one-hot at the argmax, so the acceptance rule below
    reduces exactly to the greedy rule for them. ``filters``: the batch's passes as the host
    knows them (else read off ``batch``).
    """
    shape = logits.shape
    n, v = shape[0], shape[-1]
    x = logits.float().reshape(n, -1, v)  # [N, T, V]
    temp = batch.temperature.to(x.device)[:, None, None]
    greedy = temp == 0
    if filters is None:
        filters = Filters(bool(greedy.all()), bool((batch.top_k > 0).any()), bool((batch.top_p < 1).any()))
    if filters.greedy:
        return _onehot(x).reshape(shape)
    scaled = x / torch.where(greedy, torch.ones_like(temp), temp)
    if filters.top_k:  # rows with top-k off pass through _top_k unchanged
        scaled = _top_k(scaled, batch.top_k.to(x.device))
    probs = torch.softmax(scaled, dim=-1)
    if filters.top_p:
        probs = _top_p(probs, batch.top_p.to(x.device))
    if x.device.type == "cpu" and not bool(greedy.any()):  # the CPU reads this for free: no one-hot pass
        return probs.reshape(shape)
    return torch.where(greedy, _onehot(x), probs).reshape(shape)


def _onehot(x: Tensor) -> Tensor:
    """One-hot at each row's argmax, float32; a scatter, not one_hot, which checks its ids on the
    host (a wait a captured graph cannot make)."""
    return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)


def _top_k(x: Tensor, k: Tensor) -> Tensor:
    v = x.shape[-1]
    k = torch.where(k <= 0, torch.full_like(k, v), k.clamp(max=v))  # [N]
    kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(p: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest prefix of tokens (by descending probability) whose mass reaches top_p."""
    sorted_p, idx = torch.sort(p, dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    keep_sorted = before < top_p[:, None, None]
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    p = p * keep
    return p / p.sum(-1, keepdim=True)


def sample(probs: Tensor, seed: Tensor, position: Tensor, stream: int) -> Tensor:
    """Gumbel-max draw from probs [N, V] keyed by (seed, position, stream) -> ids [N]."""
    return _draw(probs, lambda: row_key(seed, position, stream))


def _draw(probs: Tensor, keys) -> Tensor:
    """sample's draw from probs [N, V] with each row's key (``keys()`` -> [N], made only where used)."""
    if probs.device.type == "cpu" and bool((probs.amax(-1) == 1).all()):
        # every row one-hot (greedy rows): the draw is its argmax, whatever the noise; on the
        # CPU, where reading the flag waits for nothing, the noise over the vocabulary is skipped
        return probs.argmax(-1)
    u = uniform(keys(), probs.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    return (torch.log(probs) + gumbel).argmax(-1)


# ---------------------------------------------------------------- acceptance


@dataclass(frozen=True)
class Verdict:
    num_accepted: Tensor  # [N] int64, drafts accepted per row
    tokens: Tensor  # [N, K+1] int64: the accepted drafts, then the correction or bonus token


def accept_drafts(
    target_probs: Tensor,  # [N, K+1, V] from probs_from_logits
    drafts: Tensor,  # [N, K] int64
    draft_probs: Tensor | None,  # [N, K, V] drafter's q, or None for one-hot (argmax) drafts
    seed: Tensor,  # [N] int64
    first_position: Tensor,  # [N] int64: absolute position the first draft would occupy
    greedy: Tensor | None = None,  # [N] bool: rows at temperature 0 (argmax, skipping the noise)
) -> Verdict:
    """Lossless speculative acceptance. With one-hot drafts (the default drafting), see
    `_accept_matching`; with a drafter's own distribution q, see `_accept_rejection`."""
    if draft_probs is None or (greedy is not None and bool(greedy.all())):
        # greedy rows' q is one-hot at the draft and p at the argmax: the rejection rule then
        # accepts exactly the drafts equal to the argmax and emits the argmax, as matching does
        return _accept_matching(target_probs, drafts, seed, first_position, greedy)
    return _accept_rejection(target_probs, drafts, draft_probs, seed, first_position)


def _finish(drafts: Tensor, num: Tensor, last: Tensor) -> Verdict:
    n = drafts.shape[0]
    rows = torch.arange(n, device=drafts.device)
    tokens = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1)
    tokens[rows, num] = last
    return Verdict(num_accepted=num, tokens=tokens)


def _accept_matching(p: Tensor, drafts: Tensor, seed: Tensor, first: Tensor, greedy: Tensor | None) -> Verdict:
    """One-hot q: draw the target's own keyed sample t_i at every position (exactly what plain
    decoding draws there); accept while d_i == t_i; emit t_i where the run stops.

    P(accept d_i) = p_i(d_i), and on rejection t_i follows p_i with d_i removed: the rule
    "accept with probability p_i(d_i), else resample without d_i", with its randomness shared
    with plain decoding. So a seeded request emits the same tokens whether it was drafted for
    or not, alone or in any batch. Greedy rows: t_i = argmax p_i.
    """
    n, k1, v = p.shape
    pos = first[:, None] + torch.arange(k1, device=p.device)  # [N, K+1]
    if greedy is not None and bool(greedy.all()):
        t = p.argmax(-1)  # identical to the Gumbel draw from a one-hot p, without the noise
    else:
        t = sample(p.reshape(-1, v), seed.repeat_interleave(k1), pos.reshape(-1), Stream.SAMPLE).view(n, k1)
    num = (drafts == t[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # [N] leading accepted run
    return _finish(drafts, num, t.gather(1, num[:, None])[:, 0])


def _accept_rejection(p: Tensor, drafts: Tensor, q: Tensor, seed: Tensor, first: Tensor) -> Verdict:
    """Drafts sampled from q (Leviathan et al.; Chen et al.): accept d_i iff u_i < p_i(d_i) /
    q_i(d_i); at the first rejection emit a sample of normalize(max(0, p_i - q_i)); if all K
    are accepted emit a bonus sample of p_{K+1}."""
    n, k1, v = p.shape
    k = k1 - 1
    pos = first[:, None] + torch.arange(k1, device=p.device)  # [N, K+1]
    p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [N, K]
    q_d = q.gather(-1, drafts[..., None])[..., 0]  # [N, K]
    u = uniform(row_key(seed[:, None].expand(n, k), pos[:, :k], Stream.ACCEPT).reshape(-1)).reshape(n, k)
    ok = u * q_d < p_d  # u < p/q without dividing by a zero q
    num = ok.long().cumprod(dim=1).sum(dim=1)  # [N] leading accepted run
    rows = torch.arange(n, device=p.device)
    p_at = p[rows, num]  # [N, V] target distribution where the run stopped
    q_at = torch.cat([q, q.new_zeros(n, 1, v)], dim=1)[rows, num]  # zero q past the drafts
    residual = (p_at - q_at).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_at)
    at, full = pos[rows, num], num == k
    # one draw a row: the bonus sample of p where every draft stood, else the residual's, each
    # with its own stream's key (as drawing both and choosing would)
    last = _draw(torch.where(full[:, None], p_at, residual),
                 lambda: torch.where(full, row_key(seed, at, Stream.SAMPLE), row_key(seed, at, Stream.RESIDUAL)))
    return _finish(drafts, num, last)
