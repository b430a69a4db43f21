"""Test-only methods registered from outside core/methods/: drafts from the target itself.

`test_oracle` drafts the target's own continuation (greedy: argmax, so every draft is
accepted), optionally corrupting chosen draft slots; in probabilistic mode it samples from
q = (p_target + uniform) / 2 and returns that q, so drafts are accepted only sometimes.
"""

from typing import Literal

import torch

from draftline.core.contract import Proposal
from conftest import full_forward
from draftline.core.machine import Plan
from draftline.core.methods.base import Drafter, Method
from draftline.core.registry import METHODS
from draftline.core.sampling import SamplingBatch, Stream, probs_from_logits, sample
from draftline.core.spec import SpeculativeSpec


class OracleSpec(SpeculativeSpec):
    method: Literal["test_oracle"] = "test_oracle"
    num_speculative_tokens: int = 4
    corrupt_at: list[int] = []


@METHODS.register("test_oracle")
class OracleMethod(Method):
    config_model = OracleSpec

    def plan(self, target):
        return Plan(method="test_oracle", drafting="chain", num_speculative_tokens=self.cfg.num_speculative_tokens,
                    draft_sample_method=self.cfg.draft_sample_method)

    def build_drafter(self, plan, target, kv, device, dtype):
        return OracleDrafter(target, plan, self.cfg.corrupt_at)


class OracleDrafter(Drafter):
    def __init__(self, target, plan, corrupt_at):
        self.target, self.plan, self.corrupt_at = target, plan, corrupt_at

    def extend(self, req, features, first_position):
        pass

    def propose(self, reqs, rows):
        """Every row's k drafts, one draft position at a time for all rows: rows whose
        sequences have the same length share one forward (the target's, uncached)."""
        batch, k, v = rows.batch, self.plan.num_speculative_tokens, self.target.config.vocab_size
        seqs = [list(r.token_ids) for r in reqs]
        toks = torch.zeros(len(reqs), k, dtype=torch.long)
        sampled = self.plan.draft_sample_method != "greedy" and bool((batch.temperature > 0).any())
        qs = torch.zeros(len(reqs), k, v) if sampled else None  # greedy rows' drafts have no q
        for i in range(k):
            logits = self._last_logits(seqs)  # [N, V]
            for n, tok in enumerate(self._draws(logits, batch, seqs, qs, i)):
                tok = (tok + 1) % v if i in self.corrupt_at else tok
                toks[n, i] = tok
                seqs[n].append(tok)
        return Proposal(tokens=toks, probs=qs)

    def _last_logits(self, seqs):
        out = torch.empty(len(seqs), self.target.config.vocab_size)
        for length in {len(s) for s in seqs}:
            rows = [n for n, s in enumerate(seqs) if len(s) == length]
            hidden, _ = full_forward(self.target, torch.tensor([seqs[n] for n in rows]))
            out[rows] = self.target.logits(hidden[:, -1]).float()
        return out

    def _draws(self, logits, batch, seqs, qs, i):
        """Greedy rows: argmax; sampled rows: a keyed draw from q = (p + uniform) / 2, kept in qs."""
        if qs is None:
            return logits.argmax(-1).tolist()
        p = probs_from_logits(logits, batch)
        q = 0.5 * p + 0.5 / logits.shape[-1]
        drawn = sample(q, batch.seed, torch.tensor([len(s) for s in seqs]), Stream.DRAFT)
        qs[:, i] = q
        greedy = batch.temperature == 0
        return torch.where(greedy, logits.argmax(-1), drawn).tolist()
