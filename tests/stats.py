"""A chi-square goodness-of-fit p-value with torch only."""

import torch


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value that ``counts`` were drawn from ``probs`` (cells with expectation < 5 pooled)."""
    counts, probs = counts.double(), probs.double()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))
