"""Structured outputs (core/grammar.py on xgrammar) with drafting on: greedy output equals
constrained plain decoding token for token for every method, sampled output keeps the masked
target's law (chi-square), the matcher rolls back what a round does not keep, and each bad
constraint is a RequestError naming it; the cuda backend (Triton's interpreter on a CPU)
masks as the reference does."""

import json
import os
from pathlib import Path

import jsonschema
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from conftest import full_forward, respec  # noqa: E402
from draftline.core.engine import Engine, RequestError  # noqa: E402
from draftline.core.grammar import Constraint  # noqa: E402
from draftline.core.walk import best_allowed, candidates, drawn_allowed, fill_masks, walk  # noqa: E402
from draftline.core.walk import forced as forced_token  # noqa: E402
from draftline.core.sampling import SamplingBatch, SamplingParams, probs_from_logits  # noqa: E402
from draftline.core.policy import DraftPolicy, Drafted  # noqa: E402
from draftline.core.spec import load_spec  # noqa: E402
from stats import chi_square_p  # noqa: E402

pytest.importorskip("xgrammar", reason="structured outputs need the `structured` extra (xgrammar)")

SPECS = Path(__file__).parent.parent / "specs"
METHODS = ["tiny-dflash.yaml", "tiny-eagle3.yaml", "tiny-gemma4-mtp.yaml"]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:\n", "# a user record as JSON\n"]
SCHEMA = {  # nested objects, arrays, enums, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"admin": {"type": "boolean"}}, "required": ["admin"],
                  "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def plain():
    return Engine(load_spec(SPECS / "tiny-none.yaml"))


def _json(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=160, constraint=Constraint("json_schema", json.dumps(SCHEMA)), **kw)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_json_with_drafting_equals_constrained_plain_decoding(plain, method):
    drafted = Engine(load_spec(SPECS / method), plain.target, plain.tokenizer, draft_policy="always")
    params = [_json()] * len(PROMPTS)
    want = plain.generate(PROMPTS, params)
    got = drafted.generate(PROMPTS, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    for c in got:
        assert c.meta_info["finish_reason"]["type"] == "stop", c.text  # the grammar closed the object, then eos
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert sum(c.meta_info["spec_accepted_tokens"] for c in got) > 0  # drafts were kept under the mask
    assert all(c.meta_info["grammar_mask_ms_per_round"] > 0 for c in got)


@pytest.mark.parametrize("constraint", [Constraint("regex", r"[a-z_]{2,6}\(n(, [a-z]+)?\):"),
                                        Constraint.choices(["yes", "no", "maybe later"]),
                                        Constraint("grammar", 'root ::= "x = " [0-9]+ ("." [0-9]+)?'),
                                        Constraint("json_object")])
def test_every_kind_with_drafting_equals_constrained_plain_decoding(plain, constraint):
    drafted = Engine(load_spec(SPECS / "tiny-dflash.yaml"), plain.target, plain.tokenizer, draft_policy="always")
    params = SamplingParams(max_new_tokens=24, constraint=constraint)
    want = [c.output_ids for c in plain.generate(PROMPTS[:2], params)]
    assert [c.output_ids for c in drafted.generate(PROMPTS[:2], params)] == want
    if constraint.kind == "choice":
        assert {plain.tokenizer.decode(ids) for ids in want} <= {"yes", "no", "maybe later"}


def test_the_matcher_rolls_back_what_a_round_does_not_keep(plain):
    """mask_window walks a round's drafts and returns to where it was; advancing by a partial
    acceptance leaves it where a matcher fed those tokens one by one would be."""
    c = Constraint.choices(["alpha beta", "alpine"])
    tok = plain.tokenizer
    ids = tok.encode("alpha beta").ids
    stops = sorted(plain.target.config.eos_token_ids)
    m = plain.grammars.matcher(c, stops)
    vocab = plain.target.config.vocab_size
    x = torch.zeros(len(ids) + 1, vocab)
    drafts = torch.tensor(ids)
    first = m.mask_window(x, drafts)
    assert m.mask_window(x[:1], None).equal(first[:1])  # nothing was consumed
    for j in range(1, len(ids) + 1):  # slot j is masked as a matcher fed drafts 0 .. j-1
        fresh = plain.grammars.matcher(c, stops)
        fresh.advance(ids[:j])
        assert fresh.mask_window(x[:1], None)[0].equal(first[j])
    forbidden = int(torch.nonzero(first[1] == float("-inf"))[0])
    m.mask_window(x[:3], torch.tensor([ids[0], forbidden]))  # the second draft is refused
    assert m.refused == 1
    m.advance(ids[:1])  # the round kept one token
    fresh = plain.grammars.matcher(c, stops)
    fresh.advance(ids[:1])
    assert m.mask_window(x[:1], None).equal(fresh.mask_window(x[:1], None))


def _second_token_law(engine, prompt_ids, params):
    """The masked target's exact law of the 2nd token: sum_t1 p(t1) p(t2 | t1), each step's
    logits masked by the grammar after the tokens before it."""
    one = SamplingBatch.of([params])
    stops = sorted(engine.target.config.eos_token_ids)

    def mask(x, before):
        m = engine.grammars.matcher(params.constraint, stops)
        m.advance(before)
        return m.mask_window(x[None], None)[0]

    dev = engine.target.model.embed_tokens.weight.device
    with torch.no_grad():
        hidden, _ = full_forward(engine.target, torch.tensor([prompt_ids], device=dev))
        p1 = probs_from_logits(mask(engine.target.logits(hidden[0, -1]).float(), [])[None], one)[0]
        support = torch.nonzero(p1).flatten().tolist()
        hidden, _ = full_forward(engine.target, torch.tensor([prompt_ids + [t] for t in support], device=dev))
        logits = engine.target.logits(hidden[:, -1]).float()
        masked = torch.stack([mask(logits[i], [t]) for i, t in enumerate(support)])
        p2 = probs_from_logits(masked, SamplingBatch.of([params] * len(support)))
    return (p1[support, None] * p2).sum(0).cpu()


def test_sampled_tokens_follow_the_masked_target(plain):
    """Chi-square at temperature 1 with probabilistic drafts: the 2nd token (decided by the
    first accept/reject round, its slots masked) follows the masked target's law."""
    spec = load_spec(SPECS / "tiny-eagle3.yaml")
    spec = spec.with_method({**spec.speculative.model_dump(mode="python"), "num_speculative_tokens": 2,
                             "draft_sample_method": "probabilistic"})
    engine = Engine(respec(spec, "reference", max_batch_size=512), plain.target, plain.tokenizer, draft_policy="always")
    prompt = engine.encode("def ")
    n, constraint = 1500, Constraint("regex", r"[a-k][a-z_]*\(.*")
    params = [SamplingParams(temperature=1.0, top_k=8, max_new_tokens=2, seed=s, ignore_eos=True,
                             constraint=constraint) for s in range(n)]
    out = engine.generate([prompt] * n, params)
    second = torch.tensor([c.output_ids[1] for c in out])
    law = _second_token_law(engine, prompt, params[0])
    rate = sum(c.meta_info["spec_accept_rate"] for c in out) / n
    assert 0.02 < rate < 0.98  # both the accept and the reject path were exercised
    assert chi_square_p(torch.bincount(second, minlength=law.numel()), law) > 1e-3


@pytest.mark.parametrize("constraint, named", [
    (Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "strang"}}}'), "json_schema"),
    (Constraint("regex", "([a-z"), "regex"),
    (Constraint("grammar", "root ::= undefined_rule"), "grammar"),
    (Constraint("choice", "[]"), "choice"),
])
def test_a_bad_constraint_is_a_request_error_naming_it(plain, constraint, named):
    with pytest.raises(RequestError, match=named):
        plain.generate(["x"], SamplingParams(max_new_tokens=4, constraint=constraint))


def test_a_repeated_constraint_compiles_once(plain):
    c = Constraint("regex", r"[0-9]{3}-[0-9]{4}")
    first = plain.generate(["call "], SamplingParams(max_new_tokens=12, constraint=c))[0]
    again = plain.generate(["call "], SamplingParams(max_new_tokens=12, constraint=c))[0]
    assert first.meta_info["grammar_compile_ms"] > 0 and again.meta_info["grammar_compile_ms"] == 0
    assert first.output_ids == again.output_ids


def test_a_draft_the_grammar_forbids_becomes_the_token_it_forces(plain):
    """Where the grammar allows one token only (a key's quotes and colon), a wrong draft is
    replaced by it, and the walk rolls back."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    ids = plain.generate(["# json\n"], SamplingParams(max_new_tokens=160, constraint=c))[0].output_ids[:12]
    stops = sorted(plain.target.config.eos_token_ids)
    vocab = plain.target.config.vocab_size

    def allowed(before):
        m = plain.grammars.matcher(c, stops)
        m.advance(before)
        return torch.isfinite(m.mask_window(torch.zeros(1, vocab), None)[0]).sum().item()

    forced = [j for j in range(len(ids)) if allowed(ids[:j]) == 1]
    assert forced  # the object's opening and first key are forced
    m = plain.grammars.matcher(c, stops)
    wrong = [(t + 1) % vocab if j in forced else t for j, t in enumerate(ids)]
    steered = list(wrong)
    replaced = m.choose(steered, forced_token(steered))
    assert steered == ids and replaced == forced
    assert allowed([]) == torch.isfinite(m.mask_window(torch.zeros(1, vocab), None)[0]).sum().item()  # rolled back


def test_a_forbidden_draft_becomes_the_drafters_best_allowed_token(plain):
    """With the drafter's ranking at each slot, a draft the grammar forbids becomes the drafter's
    best candidate the slot's mask allows (after the drafts chosen before it), the lowest allowed
    token where it allows none of them; a draft drawn from q is drawn again from q under the
    mask, which becomes the slot's q (no mass where it forbids)."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    stops, vocab = sorted(plain.target.config.eos_token_ids), plain.target.config.vocab_size
    scores = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))  # [K, V]
    m = plain.grammars.matcher(c, stops)
    drafts = [plain.encode("hello")[0]] * 8  # forbidden at the object's opening
    ranked = candidates(scores)  # [K, CANDIDATES]
    changed = m.choose(drafts, best_allowed(drafts, ranked.numpy()))
    assert changed and m.replaced == len(changed) and m.refused == 0
    for j, token in enumerate(drafts):
        fresh = plain.grammars.matcher(c, stops)
        fresh.advance(drafts[:j])
        allowed = torch.isfinite(fresh.mask_window(torch.zeros(1, vocab), None)[0])
        ok = [int(t) for t in ranked[j] if allowed[t]]
        best = ok[0] if ok else int(allowed.nonzero()[0])
        assert token == best or (j not in changed and allowed[token])
    req = type("R", (), {"params": SamplingParams(temperature=1.0, seed=3), "seq_len": 5})()  # what a draw reads
    probs, sampled = torch.zeros(1, 8, vocab), list(drafts)
    m.choose(sampled, drawn_allowed(req, scores, probs, 0))
    for j in range(8):
        fresh = plain.grammars.matcher(c, stops)
        fresh.advance(sampled[:j])
        forbidden = ~torch.isfinite(fresh.mask_window(torch.zeros(1, vocab), None)[0])
        assert probs[0, j, forbidden].sum() == 0 and abs(float(probs[0, j].sum()) - 1) < 1e-5
        assert probs[0, j, sampled[j]] > 0


def test_a_walk_cut_at_its_reach_ends_the_round_there(plain):
    """A request whose rounds keep short runs walks only that far: the draft at its reach becomes
    a token its slot forbids (so the round keeps at most the drafts before it, and the correction
    is drawn at that slot, under its mask), and the slots past it are never masked."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    stops, vocab = sorted(plain.target.config.eos_token_ids), plain.target.config.vocab_size
    ids = plain.generate(["# json\n"], SamplingParams(max_new_tokens=160, constraint=c))[0].output_ids[:8]
    m = plain.grammars.matcher(c, stops)
    assert m.reach(7) == 7  # nothing kept yet: the whole window
    m.fill_window(xgr_bitmask(8, vocab), list(ids[:7]))
    m.advance(ids[:2])  # a drafted round kept one draft and its correction
    assert m.reach(7) == 2
    bitmask, drafts = xgr_bitmask(7, vocab), list(ids[2:])  # the next round's drafts, all allowed
    assert m.fill_window(bitmask, drafts, reach=m.reach(7)) == [2]
    assert drafts[:2] == ids[2:4] and drafts[2] != ids[4]
    fresh = plain.grammars.matcher(c, stops)
    fresh.advance(ids[:4])
    assert not torch.isfinite(fresh.mask_window(torch.zeros(1, vocab), None)[0, drafts[2]])  # forbidden: rejected
    assert bitmask[3:].eq(-1).all() and not bitmask[2].eq(-1).all()  # slot 2 masked, none after it


def test_rows_walked_together_equal_each_walked_alone(plain):
    """A batch's rows walk their windows in lockstep (one batched fill and accept a slot): each
    row's masks, chosen drafts, counts and state after the walk equal its walk alone, with rows
    that replace drafts, refuse one, are cut at their reach or hold no grammar beside it."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    stops, vocab = sorted(plain.target.config.eos_token_ids), plain.target.config.vocab_size
    ids = plain.generate(["# json\n"], SamplingParams(max_new_tokens=160, constraint=c))[0].output_ids
    ranked = candidates(torch.randn(7, vocab, generator=torch.Generator().manual_seed(1))).numpy()  # [K, M]
    starts, bad = (0, 3, 9, 20), plain.encode("hello")[0]

    def rows():
        made = []
        for r, at in enumerate(starts):
            m = plain.grammars.matcher(c, stops)
            m.advance(ids[:at])
            drafts = list(ids[at : at + 7])
            drafts[r] = bad  # forbidden at a different slot in each row
            made.append((m, drafts, None if r == 1 else best_allowed(drafts, ranked), 3 if r == 2 else None))
        return made

    alone = []
    for m, drafts, choose, reach in rows():
        bitmask = xgr_bitmask(8, vocab)
        alone.append((m.fill_window(bitmask, drafts, choose, reach), drafts, bitmask, m.replaced, m.refused))
    together, bitmask = rows(), xgr_bitmask(5 * 8, vocab)  # row 4 of the bitmask: a request with no grammar
    changed = walk([m for m, *_ in together], bitmask, [0, 8, 16, 24], [d for _, d, *_ in together],
                   [ch for *_, ch, _ in together], [r for *_, r in together], 7)
    assert bitmask[32:].eq(-1).all()
    for r, ((m, drafts, *_), (was, want, mask, replaced, refused)) in enumerate(zip(together, alone)):
        assert changed[r] == was and drafts == want and (m.replaced, m.refused) == (replaced, refused)
        assert torch.equal(bitmask[8 * r : 8 * r + 8], mask)
        m.advance(ids[starts[r] : starts[r] + 1])  # rolled back: the walk left each at its own tokens
    assert alone[1][4] == 1 and alone[0][3] == 1 and alone[2][0][-1] == 3  # refused, replaced, cut at its reach


def test_a_draft_cut_at_its_reach_keeps_the_verify_logits(plain):
    """fill_masks says which drafts changed and whether the verify forward over the old drafts
    still holds: a cut at a row's reach changes a draft the round rejects at that slot (whose
    logits read only the drafts before it), so the forward holds; a replaced draft before the
    cut does not."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    stops, vocab = sorted(plain.target.config.eos_token_ids), plain.target.config.vocab_size
    ids = plain.generate(["# json\n"], SamplingParams(max_new_tokens=160, constraint=c))[0].output_ids
    ranked = candidates(torch.randn(7, vocab, generator=torch.Generator().manual_seed(2))).numpy()

    def request(keep: int):  # a request whose drafted rounds kept ``keep`` drafts: its reach is keep + 1
        m = plain.grammars.matcher(c, stops)
        m.fill_window(xgr_bitmask(8, vocab), list(ids[:7]))
        m.advance(ids[: keep + 1])
        return type("R", (), {"grammar": m})()

    def fill(reqs, drafts):
        return fill_masks(reqs, drafts, xgr_bitmask(len(reqs) * 8, vocab).view(len(reqs), 8, -1),
                          [best_allowed(d, ranked) for d in drafts])

    cut = list(ids[2:9])  # all allowed: only the cut at slot 2 changes one
    assert fill([request(1), None], [cut, list(cut)]) == (True, False) and cut[2] != ids[4]
    replaced = list(ids[2:9])
    replaced[0] = plain.encode("hello")[0]  # forbidden before the cut
    assert fill([request(1)], [replaced]) == (True, True)
    assert fill([request(6)], [list(ids[7:14])]) == (False, False)  # walked to its end, nothing changed


def xgr_bitmask(rows: int, vocab: int) -> torch.Tensor:
    import xgrammar

    return xgrammar.allocate_token_bitmask(rows, vocab)


@pytest.mark.parametrize("method, logprobs", [("tiny-dflash.yaml", None), ("tiny-gemma4-mtp.yaml", 2)])
def test_the_cuda_backend_masks_as_the_reference(plain, method, logprobs):
    """On the cuda backend a constrained request's first token is masked in the prefill, its
    drafts are read on the host and every verify slot masked: in the decision's graph, or in
    the eager acceptance where the request also reads its logits (logprobs). Its rounds are
    synchronous, beside an unconstrained request on a backend that pipelines rounds: each
    request's tokens equal the reference's plain decoding under the same constraint (or none).
    In the graphs' case the next round's draft step and verify forward run ahead, launched
    behind each round for the same rows: the next launch takes them, also once the free request
    has ended (its row then padding), so only the first launch runs them itself; drafts the
    grammar forbids are replaced by the drafter's best allowed, and the verify runs again over them."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = respec(load_spec(SPECS / method), "cuda", max_batch_size=3, device=dev, dtype="float32", max_model_len=96)
    drafted = Engine(spec, draft_policy="always")
    rounds, calls = drafted.backend.constrained, {"launch": 0, "unmasked": 0}
    launch, unmasked = rounds.launch, rounds._unmasked
    rounds.launch = lambda *a: calls.__setitem__("launch", calls["launch"] + 1) or launch(*a)
    rounds._unmasked = lambda *a: calls.__setitem__("unmasked", calls["unmasked"] + 1) or unmasked(*a)
    regex = SamplingParams(max_new_tokens=16, logprobs=logprobs,
                           constraint=Constraint("regex", r"[a-z_]{2,6}\(n(, [a-z]+)?\):"))
    short = SamplingParams(max_new_tokens=3, logprobs=logprobs, constraint=Constraint("regex", r"[a-z ]{2,40}"))
    free = SamplingParams(max_new_tokens=10)
    params = [regex, short, free]
    want = [plain.generate([p], s)[0].output_ids for p, s in zip(PROMPTS, params)]
    got = drafted.generate(PROMPTS[:3], params)
    assert [c.output_ids for c in got] == want
    assert got[0].meta_info["spec_accepted_tokens"] > 0 and got[0].meta_info["grammar_mask_ms_per_round"] > 0
    run_anew = calls["unmasked"] - calls["launch"]  # each launch also runs the next round's part ahead
    assert run_anew == 1 < calls["launch"] if logprobs is None else calls["launch"] == 0
    if logprobs is None:  # forbidden drafts replaced by the drafter's best allowed, their verify run again
        assert got[0].meta_info["grammar_replaced_drafts"] > 0


class Alternating(DraftPolicy):
    """Drafts every other round: each constrained launch switches width."""

    def choose(self, batch_size, widths, drafted=Drafted()):
        self.decisions = getattr(self, "decisions", 0) + 1
        return widths[0] if widths and self.decisions % 2 else 1


def test_a_switch_of_width_wastes_no_forward_run_ahead(plain):
    """The machine chooses a constrained round's successor's width when it launches the round,
    so the part run ahead behind it has that width: with the width switching every round, only
    the first launch runs its unmasked part itself, and the tokens equal plain decoding's."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = respec(load_spec(SPECS / "tiny-gemma4-mtp.yaml"), "cuda", max_batch_size=1, device=dev,
                  dtype="float32", max_model_len=96)
    drafted = Engine(spec)
    drafted.machine.policy = Alternating()
    rounds, calls = drafted.backend.constrained, {"launch": 0, "unmasked": 0, "widths": []}
    launch, unmasked = rounds.launch, rounds._unmasked
    rounds.launch = lambda *a: calls.__setitem__("launch", calls["launch"] + 1) or launch(*a)
    rounds._unmasked = lambda *a: calls["widths"].append(a[1]) or unmasked(*a)
    params = SamplingParams(max_new_tokens=12, constraint=Constraint("regex", r"[a-z_]{2,6}\(n(, [a-z]+)?\):"))
    got = drafted.generate(PROMPTS[:1], params)[0]
    assert got.output_ids == plain.generate(PROMPTS[:1], params)[0].output_ids
    assert len(calls["widths"]) - calls["launch"] == 1 < calls["launch"]
    assert len(set(calls["widths"])) == 2 and got.meta_info["spec_accepted_tokens"] > 0


def test_the_mask_kernel_masks_as_xgrammar():
    """apply_masks (the cuda backend's, in its graphs) against xgrammar's own apply, on a
    vocabulary that does not fill its last 32-bit word."""
    import xgrammar as xgr

    from draftline.backends.cuda.masks import apply_masks

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1, 2] = -1  # a slot allowing everything
    want = logits.clone().view(6, 100)
    xgr.apply_token_bitmask_inplace(want, bitmask.view(6, 4), vocab_size=100)
    got = logits.to(dev)
    apply_masks(got, bitmask.to(dev))
    assert torch.equal(got.cpu().view(6, 100), want)
    assert torch.isinf(want).any() and torch.equal(want[5], logits[1, 2])

