"""core/sampling.py: keyed randomness, logit processing, and lossless acceptance."""

import pytest
import torch

from draftline.core.sampling import (
    SMALL_KEYS, SamplingBatch, SamplingParams, Stream, accept_drafts, hash32, probs_from_logits, row_key, sample,
    uniform, unit_interval,
)
from stats import chi_square_p


def _batch(n, temperature=1.0, top_k=-1, top_p=1.0, seeds=None):
    seeds = seeds if seeds is not None else range(n)
    return SamplingBatch.of([SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=s) for s in seeds])


def test_hash_matches_32bit_arithmetic():
    def ref(x):  # plain Python uint32 arithmetic
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 0xFFFFFFFF, 0xDEADBEEF, 2**31]
    assert hash32(torch.tensor(xs)).tolist() == [ref(x) for x in xs]


def test_the_cpus_numpy_draws_are_the_int64_forms_bits():
    """On the CPU row_key and uniform run in numpy's uint32 (a few keys in Python's integers);
    the int64 torch form (hash32, which the kernels reproduce) gives the same keys and the same
    floats, seeds past 2^32 included."""
    seeds = torch.tensor([0, 1, 5, 2**32 - 1, 2**32, 2**40 + 5, 2**63 - 1]).repeat(3)
    pos = torch.arange(21) * 7919
    want = hash32(hash32(hash32(hash32(seeds & 0xFFFFFFFF) ^ (seeds >> 32)) ^ pos) ^ int(Stream.RESIDUAL))
    key = row_key(seeds, pos, Stream.RESIDUAL)
    assert key.dtype == torch.int64 and torch.equal(key, want)
    for n in (1, 7, SMALL_KEYS):  # the integers' form
        small = row_key(seeds[:n], pos[:n], Stream.RESIDUAL)
        assert small.dtype == torch.int64 and torch.equal(small, want[:n])
    one_seed = hash32(hash32(hash32(hash32(seeds[5] & 0xFFFFFFFF) ^ (seeds[5] >> 32)) ^ pos[:3]) ^ int(Stream.RESIDUAL))
    assert torch.equal(row_key(seeds[5:6], pos[:3], Stream.RESIDUAL), one_seed)  # a seed broadcast over positions
    cols = hash32(torch.arange(300) + 0x9E3779B9)
    assert torch.equal(uniform(key, 300), unit_interval(hash32(hash32(want[:, None] ^ cols[None, :]))))
    assert torch.equal(uniform(key), unit_interval(hash32(want)))
    grid = row_key(seeds[:4, None].expand(4, 3), pos[:4, None] + torch.arange(3), Stream.ACCEPT)  # broadcast rows
    assert torch.equal(grid[:, 1], row_key(seeds[:4], pos[:4] + 1, Stream.ACCEPT))


def test_uniform_is_keyed_not_ordered():
    seeds, pos = torch.tensor([5, 7, 5, 2**40 + 5]), torch.tensor([3, 3, 4, 3])
    u = uniform(row_key(seeds, pos, Stream.SAMPLE), 8)
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(uniform(row_key(seeds[perm], pos[perm], Stream.SAMPLE), 8), u[perm])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2]) and not torch.equal(u[0], u[3])
    assert not torch.equal(u[0], uniform(row_key(seeds[:1], pos[:1], Stream.ACCEPT), 8)[0])


def test_uniform_is_uniform():
    u = uniform(row_key(torch.arange(200), torch.zeros(200, dtype=torch.long), Stream.SAMPLE), 500).flatten()
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert chi_square_p(counts, torch.full((20,), 0.05)) > 1e-3


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    torch.testing.assert_close(probs_from_logits(logits, _batch(1)), logits.exp())
    assert probs_from_logits(logits, _batch(1, top_k=2))[0, 2:].sum() == 0
    p = probs_from_logits(logits, _batch(1, top_p=0.8))  # 0.5 + 0.2 < 0.8 -> keep three
    torch.testing.assert_close(p[0], torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    sharp = probs_from_logits(logits, _batch(1, temperature=0.5))
    torch.testing.assert_close(sharp[0], logits.exp()[0] ** 2 / (logits.exp()[0] ** 2).sum())
    greedy = probs_from_logits(torch.tensor([[0.1, 3.0, 2.9]]), _batch(1, temperature=0.0))
    assert greedy.tolist() == [[0.0, 1.0, 0.0]]


def test_sample_follows_distribution_and_repeats():
    p = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    n = 20000
    probs, seeds = p.expand(n, -1), torch.arange(n)
    draws = sample(probs, seeds, torch.full((n,), 7), Stream.SAMPLE)
    assert chi_square_p(torch.bincount(draws, minlength=5), p) > 1e-3
    assert torch.equal(draws, sample(probs, seeds, torch.full((n,), 7), Stream.SAMPLE))


def test_greedy_acceptance_rule_is_exact():
    v, k = 11, 4
    logits = torch.randn(3, k + 1, v)
    best = logits.argmax(-1)  # [3, K+1]
    drafts = best[:, :k].clone()
    drafts[1, 2] = (best[1, 2] + 1) % v  # row 1 mismatches at position 2
    drafts[2, 0] = (best[2, 0] + 1) % v  # row 2 at position 0; row 0 all match
    probs = probs_from_logits(logits, _batch(3, temperature=0.0))
    out = accept_drafts(probs, drafts, None, torch.arange(3), torch.tensor([10, 20, 30]))
    assert out.num_accepted.tolist() == [4, 2, 0]
    assert out.tokens[0].tolist() == best[0].tolist()  # all accepted + bonus argmax p_{K+1}
    assert out.tokens[1, :3].tolist() == best[1, :3].tolist()
    assert out.tokens[2, 0] == best[2, 0]


def _accept_many(p, q, n, k=2, draft_from_q=True):
    """Rows share fixed per-position p [K+1, V] and q [K, V]; drafts are drawn from q."""
    seeds = torch.arange(n)
    first = torch.full((n,), 100)
    drafts = torch.stack(
        [sample(q[i].expand(n, -1), seeds, first + i, Stream.DRAFT) for i in range(k)], dim=1
    )
    probs = p.expand(n, -1, -1)
    qs = q.expand(n, -1, -1) if draft_from_q else None
    return accept_drafts(probs, drafts, qs, seeds, first)


@pytest.mark.parametrize("kind", ["non-degenerate q", "one-hot q"])
def test_sampled_acceptance_is_lossless(kind):
    torch.manual_seed(0)
    v, k, n = 6, 2, 40000
    p = torch.softmax(torch.randn(k + 1, v) * 1.5, -1)
    if kind == "one-hot q":  # an argmax drafter: one-hot at a likely token, then an unlikely one
        q = torch.nn.functional.one_hot(torch.stack([p[0].argmax(), p[1].argmin()]), v).float()
    else:
        q = torch.softmax(torch.randn(k, v) * 1.5, -1)
    out = _accept_many(p, q, n, k, draft_from_q=(kind != "one-hot q"))
    first = out.tokens[:, 0]
    assert chi_square_p(torch.bincount(first, minlength=v), p[0]) > 1e-3
    # given position 0 was an accepted draft, position 1 must still follow p_1
    second = out.tokens[out.num_accepted >= 1, 1]
    assert second.numel() > 1000
    assert chi_square_p(torch.bincount(second, minlength=v), p[1]) > 1e-3
    rate = out.num_accepted.float().mean()
    assert 0 < rate < k  # a real mix of accepts and rejections was tested


def test_seeded_acceptance_repeats_and_ignores_batch_order():
    torch.manual_seed(1)
    v, k, n = 7, 3, 64
    p = torch.softmax(torch.randn(n, k + 1, v), -1)
    q = torch.softmax(torch.randn(n, k, v), -1)
    drafts = torch.randint(0, v, (n, k))
    seeds, first = torch.arange(n) * 31, torch.arange(n) + 5
    a = accept_drafts(p, drafts, q, seeds, first)
    b = accept_drafts(p, drafts, q, seeds, first)
    perm = torch.randperm(n)
    c = accept_drafts(p[perm], drafts[perm], q[perm], seeds[perm], first[perm])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.tokens[perm], c.tokens) and torch.equal(a.num_accepted[perm], c.num_accepted)


def test_unit_interval_never_reaches_zero_or_one():
    h = torch.tensor([0, 1, 511, 512, 2**31, 0xFFFFFE00, 0xFFFFFFFF])
    u = unit_interval(h)
    assert (u > 0).all() and (u < 1).all()
    assert u[-1].item() == 1 - 2**-24 and u[0].item() == 2**-24
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all()


def test_sampling_a_one_hot_distribution_is_exact():
    """Greedy rows go through the same Gumbel path: it must always return the hot index."""
    v, n = 4096, 512
    hot = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(0))
    probs = torch.nn.functional.one_hot(hot, v).float()
    for position in range(4):
        assert torch.equal(sample(probs, torch.arange(n), torch.full((n,), position), Stream.SAMPLE), hot)


def test_one_hot_rows_skip_the_noise_with_the_same_draws():
    """A batch of one-hot rows returns its argmax without drawing noise: the Gumbel draw over
    the whole vocabulary, which it skips, picks the same index; one row that is not one-hot
    takes the whole batch through the draw."""

    gen = torch.Generator().manual_seed(3)
    hot = torch.randint(0, 64, (6,), generator=gen)
    probs = torch.nn.functional.one_hot(hot, 64).float()
    seed, position = torch.arange(6), torch.full((6,), 9)
    noise = -torch.log(-torch.log(uniform(row_key(seed, position, Stream.DRAFT), 64)))
    assert torch.equal(sample(probs, seed, position, Stream.DRAFT), (torch.log(probs) + noise).argmax(-1))
    probs[0] = torch.softmax(torch.randn(64, generator=gen), -1)
    assert torch.equal(sample(probs, seed, position, Stream.DRAFT), (torch.log(probs) + noise).argmax(-1))


def test_greedy_rows_with_drafts_probabilities_accept_as_matching_does():
    """Probabilistic drafts at temperature 0 are one-hot at the drafter's argmax: the rejection
    rule gives exactly what the matching rule gives, which greedy rows now take."""
    from draftline.core.sampling import _accept_matching, _accept_rejection

    gen = torch.Generator().manual_seed(4)
    n, k, v = 8, 4, 32
    for _ in range(50):
        t = torch.randint(0, v, (n, k + 1), generator=gen)
        drafts = torch.where(torch.rand(n, k, generator=gen) < 0.7, t[:, :k], torch.randint(0, v, (n, k), generator=gen))
        p, q = torch.nn.functional.one_hot(t, v).float(), torch.nn.functional.one_hot(drafts, v).float()
        seed, first = torch.arange(n), torch.randint(0, 100, (n,), generator=gen)
        slow = _accept_rejection(p, drafts, q, seed, first)
        fast = accept_drafts(p, drafts, q, seed, first, torch.ones(n, dtype=torch.bool))
        assert torch.equal(slow.num_accepted, fast.num_accepted) and torch.equal(slow.tokens, fast.tokens)
        assert torch.equal(fast.tokens, _accept_matching(p, drafts, seed, first, None).tokens)


def test_filters_known_on_the_host_take_the_passes_the_batch_would():
    """probs_from_logits with the batch's passes given from the requests' parameters (no wait on
    the device) equals the same call reading them off the batch, a top_p a hair under 1 too."""
    from draftline.core.sampling import Filters, SamplingBatch, SamplingParams, probs_from_logits

    logits = torch.randn(4, 3, 50, generator=torch.Generator().manual_seed(0))
    for params in ([SamplingParams(temperature=0.0)] * 4,
                   [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
                    SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.2)],
                   [SamplingParams(temperature=0.8, top_p=1 - 1e-9)] * 4):
        batch = SamplingBatch.of(params)
        assert Filters.of(params) == Filters(bool((batch.temperature == 0).all()), bool((batch.top_k > 0).any()),
                                             bool((batch.top_p < 1).any()))
        assert torch.equal(probs_from_logits(logits, batch, Filters.of(params)), probs_from_logits(logits, batch))


@pytest.mark.parametrize("fields, needle", [
    ({"temperature": float("nan")}, "temperature: input should be a finite number"),
    ({"temperature": -1.0}, "temperature: input should be greater than or equal to 0"),
    ({"top_p": 2.0}, "top_p: input should be less than or equal to 1"),
    ({"top_p": 0.0}, "top_p: input should be greater than 0"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"seed": -5}, "seed"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": float("inf")}, "presence_penalty: input should be a finite number"),
    ({"logit_bias": ((3, float("nan")),)}, "logit_bias"),
    ({"stop": ("ok", 5)}, "stop"),
    ({"temperature": "0.5"}, "temperature"),
])
def test_sampling_params_refuse_what_the_spec_refuses(fields, needle):
    """The Python API checks values as the spec and the HTTP API do (a NaN temperature once
    returned '' with finish reason stop)."""
    import draftline

    with pytest.raises(draftline.RequestError, match=needle):
        SamplingParams(**fields)
    SamplingParams(temperature=1, top_p=1.0, stop=["x"], max_new_tokens=None, logit_bias=((3, -100.0),))  # fine
