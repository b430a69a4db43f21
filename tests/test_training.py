"""Training code paths on a micro config (CPU): corpus split, tokenizer, a few target and
drafter steps, and the checkpoints they write round-tripping through the engine."""

import json
import re

import pytest
import torch

from draftline.core.engine import Engine
from draftline.core.methods.dflash import BlockBatch, _block_mask, training_loss
from draftline.core.models.loader import load_target, random_dflash, random_target
from draftline.core.models.tokenizer import byte_tokenizer
from draftline.core.spec import parse_spec
from draftline.core.training.bpe import train_bpe
from draftline.core.training.corpus import function_prompts, is_held_out, split_stdlib
from draftline.core.training.distill import DistillConfig, Distilled, generate, round_tau, train_dflash
from draftline.core.training.eagle3 import Eagle3TrainConfig, chain_tau, train_eagle3
from draftline.core.training.mtp import MTPTrainConfig, fixed_chain_tau, train_mtp
from draftline.core.training.pretrain import PretrainConfig, pretrain


def test_split_is_by_module_and_deterministic():
    a, b = split_stdlib(), split_stdlib()
    assert a.train.keys() == b.train.keys() and a.heldout.keys() == b.heldout.keys()
    assert not set(a.train) & set(a.heldout)
    assert all(is_held_out(m) for m in a.heldout) and not any(is_held_out(m) for m in a.train)
    assert len(a.heldout) >= 5 and len(a.train) > 5 * len(a.heldout)


def test_heldout_prompts_are_function_starts():
    split = split_stdlib()
    prompts = function_prompts(split.heldout, 100)
    assert len(prompts) == 100 and all(p["module"] in split.heldout for p in prompts)
    assert all(p["prompt"].lstrip().startswith(("def ", "async def ")) for p in prompts)


def test_bpe_has_specials_and_round_trips():
    tok = train_bpe(["def f(x):\n    return x + 1\n"] * 50 + ["class A:\n    pass\n"] * 50, 600)
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|mask|>") == 1
    text = "def g(y):\n    return y * 2  # é\n"
    assert tok.decode(tok.encode(text).ids) == text


def test_block_mask_sees_only_context_before_anchor_and_own_block():
    m = _block_mask(torch.tensor([[2, 5]]), length=8, blk=3)[0, 0]  # [6, 8 + 6]
    assert m[0, :8].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] and m[4, :8].tolist() == [1] * 5 + [0] * 3
    assert m[0, 8:].tolist() == [1, 1, 1, 0, 0, 0] and m[5, 8:].tolist() == [0, 0, 0, 1, 1, 1]


def test_training_loss_ignores_everything_at_or_after_the_anchor():
    """Perturbing tokens after the anchor (beyond the block's labels) cannot change the loss;
    perturbing a context token before it does."""
    target, drafter = random_target("tiny-qwen3", 0), random_dflash("tiny-dflash", 1)
    tokens = torch.randint(0, 256, (1, 60))
    anchors = torch.tensor([[20]])
    base, _, _ = training_loss(drafter, target, BlockBatch(tokens, anchors), 257)
    later = tokens.clone()
    later[0, 36:] = (later[0, 36:] + 1) % 256  # after the block (20..35)
    same, _, _ = training_loss(drafter, target, BlockBatch(later, anchors), 257)
    earlier = tokens.clone()
    earlier[0, 5] = (earlier[0, 5] + 1) % 256
    moved, _, _ = training_loss(drafter, target, BlockBatch(earlier, anchors), 257)
    assert torch.allclose(base, same) and not torch.allclose(base, moved)


def test_soft_loss_is_cross_entropy_to_the_targets_distribution_before_each_slot():
    """soft = 1: slot k's loss is the cross-entropy of the drafter's q to the target's p at
    anchor + k, which the target computes from the tokens up to anchor + k - 1 (an uncached
    forward here); soft = 0: the token's own cross-entropy; the overlap is sum(min(p, q))."""
    from conftest import full_forward

    target, drafter = random_target("tiny-qwen3", 0), random_dflash("tiny-dflash", 1)
    tokens = torch.randint(0, 256, (1, 40))
    batch, blk = BlockBatch(tokens, torch.tensor([[9]])), drafter.config.block_size
    with torch.no_grad():
        hidden, _ = full_forward(target, tokens)
        p = torch.softmax(target.logits(hidden[0, 9 : 9 + blk - 1]), dim=-1)  # [B-1, V]: laws of slots 1..B-1
        soft, _, overlap = training_loss(drafter, target, batch, 257, gamma=1e9, soft=1.0)  # gamma: equal weights
        hard, _, _ = training_loss(drafter, target, batch, 257, gamma=1e9, soft=0.0)
        mixed, _, _ = training_loss(drafter, target, batch, 257, gamma=1e9, soft=0.25)
    q = _drafter_probs(drafter, target, batch)  # [B-1, V]
    labels = tokens[0, 10 : 9 + blk]
    torch.testing.assert_close(soft, -(p * q.log()).sum(-1).mean(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hard, -q.log().gather(-1, labels[:, None]).mean(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mixed, 0.75 * hard + 0.25 * soft, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(overlap[0, 0], torch.minimum(p, q).sum(-1), rtol=1e-4, atol=1e-5)


def _drafter_probs(drafter, target, batch: BlockBatch) -> torch.Tensor:
    """q of slots 1..B-1 of the batch's one block, the way inference drafts it: the context's
    K/V from the target's features before the anchor, then [anchor token, MASK x (B-1)]
    attending over that context and the whole block, unmasked."""
    from conftest import full_forward

    anchor, blk = int(batch.anchors[0, 0]), drafter.config.block_size
    with torch.no_grad():
        _, features = full_forward(target, batch.tokens[:, :anchor], drafter.config.target_layer_ids)
        context = drafter.context_kv(features, torch.arange(anchor)[None])
        ids = torch.tensor([[int(batch.tokens[0, anchor])] + [257] * (blk - 1)])

        def attend(layer, q, k, v):
            keys, values = torch.cat([context[layer][0], k], dim=2), torch.cat([context[layer][1], v], dim=2)
            return torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

        hidden = drafter(target.embed(ids), torch.arange(anchor, anchor + blk)[None], attend)
        return torch.softmax(target.logits(hidden[0, 1:]), dim=-1)


def test_micro_training_round_trip(tmp_path):
    torch.manual_seed(0)
    stream = torch.randint(2, 300, (20000,), dtype=torch.int16)
    pre = PretrainConfig(preset="micro", steps=6, batch_size=4, seq_len=32, eval_every=3)
    summary = pretrain(stream, stream[:2000], 300, 0, tmp_path / "t", pre, torch.device("cpu"))
    assert summary.steps == 6 and "heldout_ppl" in summary.heldout
    byte_tokenizer(300).save(str(tmp_path / "t" / "tokenizer.json"))
    target = load_target(tmp_path / "t")
    cfg = DistillConfig(preset="micro-dflash", num_sequences=8, prompt_len=8, gen_len=12, gen_batch=4, steps=4,
                        batch_size=2, anchors=3, eval_every=2)
    corpus = {"train": stream, "heldout": stream[:2000], "train_function_starts": torch.tensor([50, 700, 9000])}
    summary = train_dflash(target, corpus, tmp_path / "d", cfg, torch.device("cpu"))
    assert summary.steps == 4 and {"heldout_tau_est", "heldout_sampled_tau_est", "heldout_tau_rounds"} <= set(summary.heldout)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    spec = parse_spec({"model": {"path": str(tmp_path / "t")},
                       "speculative": {"method": "dflash", "draft": {"path": str(tmp_path / "d")}}})
    engine = Engine(spec)
    params = engine.spec.sampling.params(max_new_tokens=6, ignore_eos=True)
    out = engine.generate([[5, 6, 7]], params)[0]
    base = engine.with_method({"method": "none"}).generate([[5, 6, 7]], params)[0]
    assert out.output_ids == base.output_ids and len(out.output_ids) == 6

    cfg = Eagle3TrainConfig(preset="micro-eagle3", num_sequences=8, prompt_len=8, gen_len=12, gen_batch=4, steps=4,
                            batch_size=2, crop=16, ttt_steps=3, eval_every=2)
    summary = train_eagle3(target, corpus, tmp_path / "e", cfg, torch.device("cpu"))
    assert summary.steps == 4 and {"heldout_loss", "heldout_tau_est", "heldout_sampled_tau_est"} <= set(summary.heldout)
    spec = parse_spec({"model": {"path": str(tmp_path / "t")},
                       "speculative": {"method": "eagle3", "draft": {"path": str(tmp_path / "e")},
                                       "num_speculative_tokens": 3}})
    eagle = Engine(spec).generate([[5, 6, 7]], params)[0]
    assert eagle.output_ids == base.output_ids

    cfg = MTPTrainConfig(preset="micro-mtp", num_sequences=8, prompt_len=8, gen_len=12, gen_batch=4, steps=4,
                         batch_size=2, crop=16, chain_steps=3, eval_every=2)
    summary = train_mtp(target, corpus, tmp_path / "m", cfg, torch.device("cpu"))
    assert summary.steps == 4 and {"heldout_loss", "heldout_tau_est", "heldout_sampled_tau_est"} <= set(summary.heldout)
    spec = parse_spec({"model": {"path": str(tmp_path / "t")},
                       "speculative": {"method": "gemma4_mtp", "draft": {"path": str(tmp_path / "m")}}})
    assert Engine(spec).generate([[5, 6, 7]], params)[0].output_ids == base.output_ids


def test_fixed_chain_tau_counts_leading_runs_at_each_start():
    correct = torch.zeros(2, 1, 4, dtype=torch.bool)  # [steps, b, T]: starts 0..2 have both steps
    correct[:, 0, 0] = True  # start 0: both right
    correct[0, 0, 1] = True  # start 1: first right only
    correct[1, 0, 2] = True  # start 2: first wrong
    assert fixed_chain_tau(correct) == pytest.approx(1.0 + (2 + 1 + 0) / 3)


def test_sampled_tau_multiplies_each_steps_chance_of_acceptance():
    """Overlaps in place of agreement: a chain's expected length is the sum of the products of
    its steps' chances (0.5, then 0.5 x 0.4), whatever the start."""
    overlap = torch.tensor([[[0.5, 0.5, 0.5]], [[0.4, 0.4, 0.4]]])  # [steps, b, T]
    assert fixed_chain_tau(overlap) == pytest.approx(1.0 + 0.5 + 0.2)
    assert chain_tau(overlap) == pytest.approx(1.0 + 0.5 + 0.2)


def test_chain_tau_counts_leading_runs_along_each_chain():
    correct = torch.zeros(3, 1, 5, dtype=torch.bool)  # [steps, b, T]
    correct[0, 0, 0] = correct[1, 0, 1] = correct[2, 0, 2] = True  # the chain started at 0: all 3 right
    correct[0, 0, 1] = True  # started at 1: first right, second (step 1 at t=2) wrong
    correct[1, 0, 3] = correct[2, 0, 4] = True  # started at 2: first wrong, so nothing counts
    assert chain_tau(correct) == pytest.approx(1.0 + (3 + 1 + 0) / 3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dense_generation_matches_engine(temperature):
    """The distillation generator agrees with the engine's `none` decoding, greedy and seeded."""
    engine = Engine(parse_spec({"model": {"random_init": {"preset": "tiny-qwen3"}}}))
    prompt = engine.encode("def f(x):")
    out = generate(engine.target, torch.tensor([prompt]), 10, temperature, seed=4)[0, len(prompt):].tolist()
    params = engine.spec.sampling.params(max_new_tokens=10, temperature=temperature, seed=4, ignore_eos=True)
    assert out == engine.generate([prompt], params)[0].output_ids


def test_round_tau_is_the_engines_tau():
    """The distillation estimate replays the engine's rounds: on the target's own greedy text,
    with the shipped tiny pair, it counts the tokens the engine emitted per round."""
    engine = Engine.from_spec("specs/tiny-dflash.yaml", draft_policy="always")
    drafter, new = engine.backend.drafter, 40
    for prompt in ("def add(a, b):\n", "class Stack:\n    def push(self, item):\n"):
        ids = engine.encode(prompt)
        out = engine.generate([ids], engine.spec.sampling.params(max_new_tokens=new, ignore_eos=True), trace=True)[0]
        full = [r for r in out.rounds if r.position - 1 + 16 <= len(ids) + new]  # blocks inside the text
        engine_tau = sum(r.accepted + 1 for r in full) / len(full)
        data = Distilled(torch.tensor([ids + out.output_ids]), torch.tensor([len(ids) - 1]))
        tau = round_tau(drafter.model, engine.target, data, drafter.mask_token_id, 16, new_tokens=new)
        assert tau == pytest.approx(engine_tau, abs=1.0 / len(full))  # a float tie may flip one token
        assert engine_tau > 1.5  # the trained pair accepts drafts: the comparison is not vacuous


CHAT_TEMPLATE = ("{%- for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + '\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{ '<assistant> ' }}{%- endif %}")


def _user_data(folder):
    """A JSONL of text and chat records, and a tokenizer folder (byte-level, 300 ids) with a chat template."""
    import random

    (folder / "tok").mkdir(parents=True)
    byte_tokenizer(300).save(str(folder / "tok" / "tokenizer.json"))
    (folder / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                     "chat_template": CHAT_TEMPLATE}))
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while drafts are verified and accepted".split()
    lines = []
    for i in range(60):
        text = " ".join(rng.choice(words) for _ in range(40))
        lines.append({"text": text} if i % 2 else
                     {"messages": [{"role": "user", "content": "say " + text[:30]}, {"role": "assistant", "content": text}]})
    (folder / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_user_corpus_from_jsonl_with_the_targets_tokenizer(tmp_path, capsys):
    from draftline.cli import main
    from draftline.core.models.tokenizer import load_tokenizer

    _user_data(tmp_path)
    argv = ["corpus", "--data", str(tmp_path / "data.jsonl"), "--tokenizer", str(tmp_path / "tok"),
            "--out", str(tmp_path / "c")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    info = json.loads(captured.out.split("\nwrote")[0])
    assert info["records"] == 60 and info["chat_records"] == 30 and info["heldout_records"] >= 1
    # 60 records hold out a few, which give fewer evaluation prompts than the 120 asked: said, not silent
    held = info["heldout_records"]
    assert info["warnings"][-1] == (f"wrote {held} evaluation prompts of the 120 asked (--prompts): the held-out "
                                    "records hold no more; give more data, or ask for fewer")
    assert "corpus.shortfall" in captured.err
    from draftline.core.training.corpus import shortfalls

    assert shortfalls("records", 1, 1, 120)[0].startswith("only 1 records held out (one in ten, by hash)")
    assert shortfalls("modules", 19, 120, 120) == []
    data = torch.load(tmp_path / "c" / "corpus.pt")
    tok = load_tokenizer(tmp_path / "tok")
    ends = data["train_function_starts"]
    assert ends.numel() > 0  # every chat record's prompt end: distillation prompts stop where the answer starts
    assert all(tok.decode(data["train"][: e + 1].tolist()[-12:]).endswith("<assistant> ") for e in ends[:5].tolist())
    assert data["vocab_size"] == 300 and data["eos_id"] == 256
    assert (tmp_path / "c" / "eval_prompts.jsonl").read_text().strip()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    assert main(["corpus", "--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "c2")]) == 1
    assert 'bad.jsonl:2: a record needs a "text" string or a "messages" list' in capsys.readouterr().err


def test_library_corpus_with_the_targets_tokenizer_and_a_mismatch_refused(tmp_path, monkeypatch, capsys):
    """`corpus --tokenizer TARGET` tokenizes the standard library as the target reads text (a
    drafter for a shipped target, on any Python), keeping the split by module; a drafter run
    whose corpus another tokenizer wrote stops before any work, naming that command."""
    from draftline.cli import main
    from draftline.core.training import corpus

    lib = tmp_path / "lib"
    lib.mkdir()
    for i in range(20):
        body = "".join(f"def f{j}_{i}(x):\n    y = x + {j}\n    return y\n\n" for j in range(12))
        (lib / f"mod{i}.py").write_text(body)
    monkeypatch.setattr(corpus, "stdlib_root", lambda: lib)
    _user_data(tmp_path)
    assert main(["corpus", "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "c"), "--prompts", "8"]) == 0
    assert (tmp_path / "c" / "tokenizer.json").read_text() == (tmp_path / "tok" / "tokenizer.json").read_text()
    data = torch.load(tmp_path / "c" / "corpus.pt")
    held = {f"mod{i}" for i in range(20) if is_held_out(f"mod{i}")}
    assert data["vocab_size"] == 300 and data["eos_id"] == 256 and data["heldout_function_starts"].numel() == 12 * len(held)
    prompts = [json.loads(line) for line in (tmp_path / "c" / "eval_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 8 and {p["module"] for p in prompts} <= held
    capsys.readouterr()

    stream = torch.randint(2, 300, (4000,), dtype=torch.int16)
    pretrain(stream, stream[:1000], 300, 0, tmp_path / "t", PretrainConfig(preset="micro", steps=1, batch_size=2,
             seq_len=16, eval_every=1), torch.device("cpu"))
    train_bpe(["def f(x):\n    return x\n"] * 20, 512).save(str(tmp_path / "t" / "tokenizer.json"))
    argv = ["train", "dflash", "--data", str(tmp_path / "c"), "--target", str(tmp_path / "t"), "--device", "cpu",
            "--preset", "micro-dflash", "--out", str(tmp_path / "d")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"its tokenizer.json is not --target {tmp_path / 't'}'s" in err
    assert f"`draftline corpus --tokenizer {tmp_path / 't'} --out {tmp_path / 'c'}`" in err
    assert not (tmp_path / "d").exists()


def test_cli_training_keeps_its_budget_and_resumes(tmp_path, capsys):
    """A drafter trained from the user's JSONL: --num-sequences smaller than --gen-batch
    generates only those; --max-seconds bounds the whole run (generation included) and leaves
    a z-lab DFlash checkpoint that loads and serves; --init starts a new run from it, --resume
    goes on with the same run, and a resume that does not fit the run is one line and exit 1."""
    import shutil
    import time

    from draftline.cli import main
    from draftline.core.models.loader import load_dflash

    torch.manual_seed(0)
    stream = torch.randint(2, 300, (20000,), dtype=torch.int16)
    _user_data(tmp_path)
    assert main(["corpus", "--data", str(tmp_path / "data.jsonl"), "--tokenizer", str(tmp_path / "tok"),
                 "--out", str(tmp_path / "corpus")]) == 0
    capsys.readouterr()
    pretrain(stream, stream[:2000], 300, 0, tmp_path / "t", PretrainConfig(preset="micro", steps=2, batch_size=4,
             seq_len=32, eval_every=2), torch.device("cpu"))
    byte_tokenizer(300).save(str(tmp_path / "t" / "tokenizer.json"))
    argv = ["train", "dflash", "--data", str(tmp_path / "corpus"), "--target", str(tmp_path / "t"), "--device", "cpu",
            "--preset", "micro-dflash", "--num-sequences", "8", "--gen-len", "12", "--steps", "1000000",
            "--batch-size", "2", "--anchors", "3", "--max-seconds", "3"]
    started = time.perf_counter()
    assert main(argv + ["--out", str(tmp_path / "d")]) == 0
    assert time.perf_counter() - started < 3 + 10  # the budget, plus one evaluation and saving
    report = capsys.readouterr().out
    steps = int(re.search(r"dflash: (\d+) steps", report).group(1))
    assert 0 < steps < 1_000_000
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and {"block_size", "dflash_config", "num_target_layers"} <= set(raw)
    load_dflash(tmp_path / "d")
    spec = parse_spec({"model": {"path": str(tmp_path / "t"), "tokenizer": str(tmp_path / "tok")},
                       "speculative": {"method": "dflash", "draft": {"path": str(tmp_path / "d")}},
                       "backend": "reference"})
    out = Engine(spec).generate(["<user> say the"], spec.sampling.params(max_new_tokens=4))[0]
    assert len(out.output_ids) == 4
    assert main(argv + ["--out", str(tmp_path / "d2"), "--init", str(tmp_path / "d")]) == 0
    load_dflash(tmp_path / "d2")
    capsys.readouterr()

    d, t = str(tmp_path / "d"), str(tmp_path / "t")  # the budget's run, resumed in its own folder
    assert main(["train", "dflash", "--resume", d, "--target", t, "--device", "cpu", "--max-seconds", "2"]) == 0
    report = capsys.readouterr().out
    assert f"steps (resumed at step {steps})" in report
    assert int(re.search(r"dflash: (\d+) steps", report).group(1)) > steps
    load_dflash(tmp_path / "d")
    pretrain(stream, stream[:2000], 300, 0, tmp_path / "t2", PretrainConfig(preset="micro", steps=1, batch_size=4,
             seq_len=32, eval_every=2, seed=1), torch.device("cpu"))
    capsys.readouterr()
    shutil.copytree(d, tmp_path / "damaged")
    state = tmp_path / "damaged" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # a run killed mid-copy, say
    refused = [(["eagle3", "--resume", d, "--target", t], "--resume " + d + ": it holds a dflash run, not eagle3"),
               (["dflash", "--resume", d, "--target", t, "--preset", "tiny-code-dflash"],
                "--preset tiny-code-dflash differs from the run's micro-dflash"),
               (["dflash", "--resume", d, "--target", str(tmp_path / "t2")], "same shape, other weights"),
               (["dflash", "--resume", t, "--target", t], "no training_state.pt there"),
               (["dflash", "--resume", d, "--init", d, "--target", t], "--resume and --init: give one"),
               (["dflash", "--resume", d, "--target", t, "--steps", "1"], "nothing is left; give a larger --steps"),
               (["dflash", "--resume", str(tmp_path / "damaged"), "--target", t], "training_state.pt is not readable")]
    for args, message in refused:
        assert main(["train", *args, "--device", "cpu"]) == 1, args
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: ") and err.count("\n") == 1, err


class _Killed(Exception):
    """Stands for the process dying right after a periodic checkpoint."""


def _train_fn(method):
    micro = dict(num_sequences=8, prompt_len=8, gen_len=12, gen_batch=4, steps=4, warmup=2, batch_size=2, eval_every=2)
    if method == "dflash":
        return train_dflash, DistillConfig(preset="micro-dflash", anchors=3, **micro)
    if method == "eagle3":
        return train_eagle3, Eagle3TrainConfig(preset="micro-eagle3", crop=16, ttt_steps=3, **micro)
    return train_mtp, MTPTrainConfig(preset="micro-mtp", crop=16, chain_steps=3, **micro)


@pytest.mark.parametrize("method", ["dflash", "eagle3", "gemma4_mtp"])
def test_resumed_run_ends_where_one_run_does(tmp_path, monkeypatch, method):
    """4 steps in one go, and 2 steps cut off after their checkpoint then resumed for the other
    2, end with the same weights, optimizer moments and loss; the published files beside the
    state stay in their dialect and load."""
    from draftline.core.models.loader import load_dflash, random_target
    from draftline.core.models.eagle3 import load_eagle3
    from draftline.core.models.gemma4_mtp import load_mtp
    from draftline.core.training.state import STATE_FILE, StateWriter, load_state

    torch.manual_seed(0)
    stream = torch.randint(2, 300, (20000,), dtype=torch.int16)
    corpus = {"train": stream, "heldout": stream[:2000], "train_function_starts": torch.tensor([50, 700, 9000])}
    target, cpu = random_target("micro", 0), torch.device("cpu")
    train, cfg = _train_fn(method)
    whole = train(target, corpus, tmp_path / "whole", cfg, cpu)

    save = StateWriter.save

    def save_then_die(self, pos, *rest):
        save(self, pos, *rest)
        if pos.step == 2:
            raise _Killed

    monkeypatch.setattr(StateWriter, "save", save_then_die)
    with pytest.raises(_Killed):
        train(target, corpus, tmp_path / "cut", cfg, cpu)
    monkeypatch.setattr(StateWriter, "save", save)
    state = load_state(tmp_path / "cut", method)
    assert state["step"] == 2
    resumed = train(target, None, tmp_path / "cut", cfg, cpu, init=tmp_path / "cut", resume=state)
    assert resumed.steps == 4 and resumed.resumed_at == 2
    assert resumed.loss == pytest.approx(whole.loss, rel=1e-5)
    a, b = (torch.load(tmp_path / run / STATE_FILE, weights_only=True) for run in ("whole", "cut"))
    for name, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][name], w, rtol=1e-5, atol=1e-6)
    for i, moments in a["optimizer"]["state"].items():
        torch.testing.assert_close(b["optimizer"]["state"][i]["exp_avg_sq"], moments["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-9)
    assert a["step"] == b["step"] == 4
    raw = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert "training" not in json.dumps(raw)  # the state is beside the published config, not in it
    {"dflash": load_dflash, "eagle3": load_eagle3, "gemma4_mtp": load_mtp}[method](tmp_path / "cut")


def test_a_resumed_budget_run_keeps_its_decayed_learning_rate():
    """A run its --max-seconds cut off ended with its learning rate decayed (time progress
    0.99): resumed, the schedule goes on from there rather than back to the peak."""
    from draftline.core.training.loop import Schedule, train_loop
    from draftline.core.training.state import Position

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    lrs = []

    def loss():
        lrs.append(opt.param_groups[0]["lr"])
        return model(torch.ones(1, 2)).sum()

    cfg = Schedule(steps=3, lr=1.0, warmup=1, eval_every=10, max_seconds=60)
    summary = train_loop("t", model, opt, loss, dict, cfg, torch.device("cpu"), start=Position(1, 0.99))
    assert summary.steps == 3 and len(lrs) == 2 and max(lrs) < 0.04  # the floor is 0.03 of the peak
    lrs.clear()
    train_loop("t", model, opt, loss, dict, cfg, torch.device("cpu"), start=Position(1, 0.0))
    assert min(lrs) > 0.5  # the same steps of a fresh schedule: near the peak


def test_target_heldout_evaluation_stops_at_the_budget():
    """`train target`'s held-out loss, once the budget is spent, is the first batch's (32
    windows) rather than all 256 windows'; unbudgeted it reads them all."""
    from draftline.core.models.loader import random_target
    from draftline.core.training.loop import Budget
    from draftline.core.training.pretrain import heldout_loss

    torch.manual_seed(0)
    tokens = torch.randint(2, 300, (256 * 16 + 1,))
    model, cpu = random_target("micro", 0), torch.device("cpu")
    spent = Budget(1e-9)
    first = heldout_loss(model, tokens, 16, cpu, max_windows=32)
    assert heldout_loss(model, tokens, 16, cpu, budget=spent) == pytest.approx(first)
    assert heldout_loss(model, tokens, 16, cpu) != pytest.approx(first)
    assert heldout_loss(model, tokens, 16, cpu, budget=Budget(None)) == heldout_loss(model, tokens, 16, cpu)


def test_cli_target_training_keeps_its_budget(tmp_path, capsys):
    """`draftline train target --max-seconds`: steps, evaluations and the checkpoint inside
    the budget (plus one step and saving), and the checkpoint loads."""
    import time

    from draftline.cli import main

    _user_data(tmp_path)
    assert main(["corpus", "--data", str(tmp_path / "data.jsonl"), "--tokenizer", str(tmp_path / "tok"),
                 "--out", str(tmp_path / "corpus")]) == 0
    started = time.perf_counter()
    assert main(["train", "target", "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "t"), "--device", "cpu",
                 "--preset", "micro", "--seq-len", "16", "--batch-size", "4", "--steps", "1000000", "--eval-every", "5",
                 "--max-seconds", "2"]) == 0
    assert time.perf_counter() - started < 2 + 2
    steps = int(re.search(r"target: (\d+) steps", capsys.readouterr().out).group(1))
    assert 5 < steps < 1_000_000
    assert load_target(tmp_path / "t").config.vocab_size == 300


def test_trained_target_has_a_tokenizer_hf_reads_as_draftline_does(tmp_path, capsys):
    """`corpus` (its own BPE) then `train target`: the target folder carries tokenizer_config.json
    and a chat template, so AutoTokenizer splits text as draftline does and both render a chat alike."""
    transformers = pytest.importorskip("transformers")
    from draftline.cli import main
    from draftline.core.models.chat_template import load_chat_template
    from draftline.core.models.tokenizer import load_tokenizer

    _user_data(tmp_path)
    text_only = [line for line in (tmp_path / "data.jsonl").read_text().splitlines() if '"text"' in line]
    (tmp_path / "text.jsonl").write_text("\n".join(text_only * 4) + "\n")
    assert main(["corpus", "--data", str(tmp_path / "text.jsonl"), "--vocab-size", "512",
                 "--out", str(tmp_path / "c")]) == 0
    assert main(["train", "target", "--data", str(tmp_path / "c"), "--out", str(tmp_path / "t"), "--device", "cpu",
                 "--preset", "micro", "--steps", "1", "--batch-size", "2", "--seq-len", "16"]) == 0
    capsys.readouterr()
    for folder in (tmp_path / "c", tmp_path / "t"):
        hf = transformers.AutoTokenizer.from_pretrained(folder)
        ours = load_tokenizer(folder)
        for text in ["the quick fox<|endoftext|>  jumps\n\n over", "  a\n\n\n b\t\tc  ", "日本語 ✓"]:
            assert hf.encode(text) == ours.encode(text, add_special_tokens=False).ids
        chat = [{"role": "user", "content": "say the"}, {"role": "assistant", "content": "the quick"}]
        assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            load_chat_template(folder).render(chat, add_generation_prompt=True)
    with_template = tmp_path / "c2"  # from the user's tokenizer folder: its own template is kept
    assert main(["corpus", "--data", str(tmp_path / "data.jsonl"), "--tokenizer", str(tmp_path / "tok"),
                 "--out", str(with_template)]) == 0
    assert load_chat_template(with_template).source == CHAT_TEMPLATE
    assert transformers.AutoTokenizer.from_pretrained(with_template).encode("fox  jumps") == \
        load_tokenizer(tmp_path / "tok").encode("fox  jumps", add_special_tokens=False).ids


def test_a_budget_spent_before_the_first_step_trains_none_and_still_saves():
    """--max-seconds counts generation: a run whose generation spent the budget takes no
    step (a step alone can outlast a small budget), evaluates and saves what it has, and its
    reported wall time includes the generation."""
    import time

    from draftline.core.training.loop import Budget, Schedule, train_loop
    from draftline.core.training.state import Position

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    budget = Budget(0.05, started=time.perf_counter() - 1.0)  # a second of "generation" already spent
    saved = []
    summary = train_loop("t", model, opt, lambda: model(torch.ones(1, 4)).sum(), lambda: {"heldout_loss": 1.5},
                         Schedule(steps=10, eval_every=5, max_seconds=0.05), torch.device("cpu"), save=saved.append,
                         budget=budget)
    assert summary.steps == 0 and summary.heldout == {"heldout_loss": 1.5} and saved == [Position(0)]
    assert float(re.search(r"wall ([0-9.]+) s", summary.report()).group(1)) >= 1.0
