"""Simulated acceptance (bench --acceptance): the profiles, and what the override does to a
draft step's drafts."""

import pytest
import torch

from draftline.core.simulated import SimulatedAcceptance, expected_tau, profile_rate


def test_profiles_name_the_papers_rates_and_refuse_nonsense():
    assert profile_rate("random") is None
    assert profile_rate("dflash-paper") == 0.86 and profile_rate("chain-paper") == 0.70
    assert profile_rate("0.5") == 0.5
    for bad in ("0", "1.5", "fast"):
        with pytest.raises(ValueError, match="random, dflash-paper, chain-paper"):
            profile_rate(bad)
    assert abs(expected_tau(0.86, 15) - 6.5) < 0.05  # the DFlash paper's Qwen3-8B tau at block 16
    assert abs(expected_tau(0.70, 6) - 3.06) < 0.05  # EAGLE-3's published Qwen3-8B figure at 6 drafts
    assert expected_tau(None, 15) == 1.0


def test_drafts_follow_the_continuation_up_to_one_wrong_position():
    vocab, k = 50, 6
    prompts = {(1, 2, 3): list(range(10, 40)), (4, 5): list(range(20, 45))}
    sim = SimulatedAcceptance(0.7, prompts, num_slots=4, max_len=64, vocab=vocab, device=torch.device("cpu"))
    sim.admit(2, [1, 2, 3])
    sim.admit(0, [4, 5])
    with pytest.raises(KeyError, match="greedy continuation"):
        sim.admit(1, [9])
    runs, accepted = 0, 0
    for start in range(2, 20):
        slots, starts = torch.tensor([2, 0]), torch.tensor([start, start + 1])
        drafts = torch.full((2, k), -1)
        sim(slots, starts, drafts)
        for row, (slot, s) in enumerate(zip(slots.tolist(), starts.tolist())):
            truth = sim.table[slot, s + 1 : s + 1 + k]
            right = (drafts[row] == truth).long()
            run = int(right.cumprod(0).sum())
            assert run == k or (drafts[row, run] == (truth[run] + 1) % vocab and bool((right[run + 1:] == 1).all()))
            runs, accepted = runs + 1, accepted + run
    assert 1.0 < accepted / runs < 4.0  # about expected_tau(0.7, 6) - 1 = 2.06 over these 36 rounds
