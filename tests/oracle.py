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
        batch = rows.batch
        k, v = self.plan.num_speculative_tokens, self.target.config.vocab_size
        rows = [self._one(r, batch, i, k, v) for i, r in enumerate(reqs)]
        tokens = torch.stack([t for t, _ in rows])
        probs = None if rows[0][1] is None else torch.stack([q for _, q in rows])
        return Proposal(tokens=tokens, probs=probs)

    def _one(self, req, batch, row, k, v):
        seq, toks, qs = list(req.token_ids), [], []
        for i in range(k):
            hidden, _ = full_forward(self.target, torch.tensor([seq]))
            logits = self.target.logits(hidden[:, -1])  # [1, V]
            if self.plan.draft_sample_method == "greedy" or float(batch.temperature[row]) == 0:
                tok = int(logits.argmax())
            else:
                p = probs_from_logits(logits, _row(batch, row))
                q = 0.5 * p + 0.5 / v
                tok = int(sample(q, batch.seed[row:row + 1], torch.tensor([len(seq)]), Stream.DRAFT))
                qs.append(q[0])
            if i in self.corrupt_at:
                tok = (tok + 1) % v
            toks.append(tok)
            seq.append(tok)
        return torch.tensor(toks), (torch.stack(qs) if qs else None)


def _row(batch, i):
    return SamplingBatch(batch.temperature[i:i + 1], batch.top_k[i:i + 1], batch.top_p[i:i + 1], batch.seed[i:i + 1])
