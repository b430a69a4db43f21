"""Prometheus metrics, one registry per app so several servers can share a process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from draftline.core.engine import Completion
from draftline.core.request import Request

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "draftline:"
        self.drafts = Counter(f"{p}spec_decode_num_drafts", "Rounds that drafted", registry=r)
        self.draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens", "Tokens drafted", registry=r)
        self.accepted = Counter(f"{p}spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.accepted_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position",
                                    ["position"], registry=r)
        self.verify = Counter(f"{p}spec_decode_num_verify_steps", "Target verify steps (rounds)", registry=r)
        self.requests = Counter(f"{p}requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prefix_queries = Counter(f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(f"{p}prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter(f"{p}num_preemptions", "Times a request's KV was dropped for blocks and recomputed",
                                   registry=r)
        self.rejected = Counter(f"{p}requests_rejected", "Requests refused before running", ["reason"], registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{p}time_per_output_token_seconds", "Time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)

    def finished(self, req: Request, c: Completion) -> None:
        s = req.stats
        self.drafts.inc(s.drafted_rounds)
        self.draft_tokens.inc(s.draft_tokens)
        self.accepted.inc(s.accepted_tokens)
        self.verify.inc(s.verify_ct)
        for i, n in enumerate(s.accepted_per_pos):
            if n:
                self.accepted_pos.labels(position=str(i)).inc(n)
        self.requests.labels(finish_reason=(req.finish_reason or {}).get("type", "unknown")).inc()
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.prefix_queries.inc(len(req.prompt_ids))
        self.prefix_hits.inc(req.cached_tokens)
        self.generation_tokens.inc(len(req.output_ids))
        self.preemptions.inc(req.preemptions)
        end = req.t_finish or req.t_arrival
        self.e2e.observe(end - req.t_arrival)
        if req.t_first_token is not None:
            self.ttft.observe(req.t_first_token - req.t_arrival)
            if len(req.output_ids) > 1:
                self.tpot.observe((end - req.t_first_token) / (len(req.output_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
