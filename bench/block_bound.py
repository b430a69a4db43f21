"""How far a block drafter's sampled drafts can be accepted at all (CPU or GPU, reference math).

A block drafter (DFlash) proposes every slot of its block in one forward, so slot k's draft is
drawn without seeing the drafts before it, while the target judges it after them. The best
such drafter that its soft loss can reach on sampled text draws slot k from the target's own
marginal m_k (the law of the k-th next token, the tokens between sampled from the target at
the same temperature). This measures that drafter: for each prompt, m_k from ``--samples``
target continuations, then ``--rounds`` rounds drafting every slot from m_k independently and
verifying them as the engine does (accept d_k while u < p_k(d_k | the drafts before) / m_k(d_k)).
A chain drafter that matched the target would accept everything; the gap to K + 1 here is what
drafting in parallel costs.

`python bench/block_bound.py [--spec specs/tiny-dflash.yaml] [--dataset humaneval] [--prompts 32]
[--samples 64] [--rounds 64] [--block 16] [--temperature 1.0]`: prints the acceptance of each
slot given the ones before were accepted, and the τ bound (tokens a round, the bonus included).
"""

from __future__ import annotations

import argparse

import torch

from draftline.core.datasets import load_dataset
from draftline.core.engine import Engine
from draftline.core.models.layers import causal_attention
from draftline.core.models.target import TargetModel
from draftline.core.training.distill import generate


@torch.no_grad()
def laws(target: TargetModel, seqs: torch.Tensor, first: int, k: int, temperature: float) -> torch.Tensor:
    """seqs [M, L] -> the target's law [M, k, V] of positions first .. first + k - 1."""
    positions = torch.arange(seqs.shape[1])[None].expand(seqs.shape[0], -1)
    hidden, _ = target(seqs, positions, causal_attention)
    return torch.softmax(target.logits(hidden[:, first - 1 : first - 1 + k]) / temperature, dim=-1)


@torch.no_grad()
def bound(target: TargetModel, prompt: torch.Tensor, args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    """Accepted drafts per round [rounds] for one prompt, slots drawn from the marginals m_k."""
    k, n = args.block - 1, prompt.shape[0]
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    seqs = generate(target, prompt[None].expand(args.samples, -1), k, args.temperature, seed)  # [M, P + k]
    marginal = laws(target, seqs, n, k, args.temperature).mean(0)  # [k, V]
    drafts = torch.stack([torch.multinomial(marginal[j], args.rounds, replacement=True, generator=gen)
                          for j in range(k)], dim=1)  # [R, k]
    p = laws(target, torch.cat([prompt[None].expand(args.rounds, -1), drafts], dim=1), n, k, args.temperature)
    p_d = p.gather(-1, drafts[..., None])[..., 0]  # [R, k]
    m_d = marginal.gather(-1, drafts.T).T  # [R, k]
    ok = torch.rand(args.rounds, k, generator=gen) * m_d < p_d
    return ok.long().cumprod(dim=1).sum(dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="specs/tiny-dflash.yaml", help="the target is this spec's")
    ap.add_argument("--dataset", default="humaneval", help="as `draftline eval --dataset`")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=64, help="target continuations each marginal is averaged over")
    ap.add_argument("--rounds", type=int, default=64, help="rounds drafted from the marginals per prompt")
    ap.add_argument("--block", type=int, default=16, help="block size (K + 1)")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    engine = Engine.from_spec(args.spec, draft_policy="always")
    gen = torch.Generator().manual_seed(0)
    accepted = torch.cat([bound(engine.target, torch.tensor(engine.encode(p)), args, gen)
                          for p in load_dataset(args.dataset).prompts[: args.prompts]])
    reached = torch.stack([(accepted >= j).float().mean() for j in range(args.block)])  # P(first j accepted)
    given = [float(reached[j + 1] / reached[j]) if reached[j] else 0.0 for j in range(args.block - 1)]
    print(f"{args.prompts} prompts of {args.dataset}, temperature {args.temperature}, block {args.block}, "
          f"{args.samples} continuations a marginal, {accepted.numel()} rounds")
    print("slot acceptance given the slots before: " + " ".join(f"{a:.2f}" for a in given))
    print(f"tau bound (parallel drafts from the target's own marginals): {1 + accepted.float().mean():.2f} "
          f"of {args.block} (a chain drafter matching the target: {args.block})")


if __name__ == "__main__":
    main()
