"""The `draftline` command line, run in-process and as the installed console script."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftline.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny-random-dflash.yaml")
META = {"finish_reason", "prompt_tokens", "completion_tokens", "spec_verify_ct", "spec_accept_length",
        "spec_accept_rate", "spec_accept_per_pos", "tokens_per_s"}


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_compare_trace(capsys):
    out = _json(capsys, ["generate", "--spec", TINY, "--max-new-tokens", "12", "--json", "--compare", "--trace",
                         "def fib(n):"])
    assert META <= set(out["meta_info"]) and META <= set(out["baseline"]["meta_info"])
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) <= 12
    assert out["output_ids"] == out["baseline"]["output_ids"]  # greedy: lossless
    assert out["speedup"] > 0 and len(out["meta_info"]["spec_accept_per_pos"]) == 15
    rounds = out["rounds"]
    assert len(rounds) == out["meta_info"]["spec_verify_ct"]
    assert sum(len(r["emitted"]) for r in rounds) + 1 == len(out["output_ids"])
    assert all(len(r["drafted"]) == 15 and r["accepted"] <= 15 for r in rounds)


def test_generate_sampled_is_seeded(capsys):
    argv = ["generate", "--spec", TINY, "--max-new-tokens", "10", "--temperature", "1.0", "--seed", "7", "--json", "x"]
    assert _json(capsys, argv)["output_ids"] == _json(capsys, argv)["output_ids"]


def test_generate_text_output(capsys):
    assert main(["generate", "--spec", TINY, "--max-new-tokens", "5", "--compare", "hi"]) == 0
    out = capsys.readouterr().out
    assert "tau" in out and "speedup" in out and "output identical" in out


def test_generate_no_tokens_compare_has_no_speedup_to_print(capsys):
    assert main(["generate", "--spec", TINY, "--max-new-tokens", "0", "--compare", "hi"]) == 0
    out = capsys.readouterr().out
    assert "speedup n/a (no tokens generated)" in out and "None" not in out


def test_explain_prints_machine(capsys):
    assert main(["explain", TINY]) == 0
    out = capsys.readouterr().out
    for needle in ["K (drafts/round):     15", "parallel", "target layers tapped: [1, 3]", "drafter KV:           own",
                   "ACCEPT   -> DRAFT | FINISHED"]:
        assert needle in out


def test_explain_prints_the_dialect_and_every_option(capsys, tmp_path):
    head = ROOT / "tests" / "fixtures" / "speculators" / "trained-defaults"
    spec = tmp_path / "s.yaml"
    spec.write_text("model: {random_init: {preset: tiny-qwen3}}\n"
                    f"speculative: {{method: eagle3, draft: {{path: {head}}}}}\nbackend: reference\n")
    assert main(["explain", str(spec)]) == 0
    out = capsys.readouterr().out
    for needle in ["speculators EAGLE-3 dialect", "qwen3 layer (q/k norms)", "draft vocabulary 256 of 384",
                   "norm_before_fc", "norm_before_residual", "norm_output", "tapped layer inputs [1, 2, 3]",
                   "its own embed_tokens", "target layers tapped: [0, 1, 2]"]:
        assert needle in out, needle


def test_bad_inputs_give_clear_errors(capsys, tmp_path):
    assert main(["generate", "--spec", str(tmp_path / "missing.yaml"), "x"]) == 1
    assert "file not found" in capsys.readouterr().err
    assert main(["generate", "--spec", TINY, ""]) == 1
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["explain", str(ROOT / "specs" / "qwen3-8b-dflash-b16.yaml")]) == 1
    assert "config.json: file not found" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("draftline") is None, reason="console script not installed (pip install -e .)")
def test_console_script():
    res = subprocess.run(["draftline", "validate", str(ROOT / "specs")], capture_output=True, text=True)
    assert res.returncode == 0 and "invalid" in res.stdout


def test_knobs_that_do_not_apply_are_refused(capsys, tmp_path):
    """`--warm-tokens` belongs to drafter training: the target command names it and exits 1."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    import torch

    torch.save({"train": torch.zeros(10), "heldout": torch.zeros(10), "vocab_size": 8, "eos_id": 0},
               corpus / "corpus.pt")
    assert main(["train", "target", "--data", str(corpus), "--out", str(tmp_path / "t"), "--warm-tokens", "4"]) == 1
    assert "--warm-tokens does not apply" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench", "--spec", str(ROOT / "specs" / "qwen3-8b-random-none.yaml")]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


def test_bench_verify_widths_need_accepted_drafts(capsys):
    assert main(["bench", "--spec", str(ROOT / "specs" / "qwen3-8b-random-dflash.yaml"), "--verify-widths", "16,8"]) == 1
    assert "give --acceptance PROFILE too" in capsys.readouterr().err


def test_cuda_backend_on_a_cpu_says_what_to_use(capsys, tmp_path, monkeypatch):
    if __import__("torch").cuda.is_available():
        pytest.skip("checks the message shown without a GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter is what lets tests run it on a CPU
    # (the check runs before anything imports Triton, so no kernel is defined outside the interpreter)
    spec = tmp_path / "s.yaml"
    spec.write_text("model: {random_init: {preset: tiny-qwen3}, device: cpu}\nbackend: cuda\n")
    assert main(["generate", "--spec", str(spec), "x"]) == 1
    assert "on a CPU use backend: reference" in capsys.readouterr().err


def _truncated_target(tmp_path):
    folder = tmp_path / "target"
    shutil.copytree(ROOT / "specs" / "tiny" / "target", folder)
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(100_000)
    return folder


def test_truncated_weights_name_the_file(capsys, tmp_path):
    """A damaged model.safetensors: one line naming the file; --check-files opens the header."""
    folder = _truncated_target(tmp_path)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model: {{path: {folder}}}\n")
    assert main(["validate", str(spec)]) == 0
    assert main(["validate", "--check-files", str(spec)]) == 1
    assert "model.safetensors: not a readable safetensors file" in capsys.readouterr().out
    assert main(["generate", "--spec", str(spec), "x"]) == 1
    assert "truncated or damaged" in capsys.readouterr().err


def test_cuda_device_without_cuda_says_so(capsys, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("checks the message shown without a GPU")
    spec = tmp_path / "s.yaml"
    spec.write_text("model: {random_init: {preset: tiny-qwen3}, device: cuda}\nbackend: reference\n")
    assert main(["validate", str(spec)]) == 0
    assert "note: model.device: cuda, but torch sees no CUDA device" in capsys.readouterr().out
    assert main(["validate", "--check-files", str(spec)]) == 1
    assert main(["generate", "--spec", str(spec), "x"]) == 1
    assert "set model.device: auto or cpu" in capsys.readouterr().err


def test_eval_plot_without_matplotlib_fails_first(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["eval", TINY, "--plot", "x.png", "--prompts", "/nonexistent"]) == 1
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_train_checks_its_target_before_any_work(capsys, tmp_path):
    missing_corpus = str(tmp_path / "no-corpus")  # were the corpus read first, this would be the error
    assert main(["train", "dflash", "--data", missing_corpus, "--out", str(tmp_path / "o")]) == 1
    assert "needs --target FOLDER" in capsys.readouterr().err
    assert main(["train", "eagle3", "--data", missing_corpus, "--out", str(tmp_path / "o"),
                 "--target", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "--target" in err and "no config.json there" in err and "spec" not in err
    assert main(["train", "dflash", "--data", missing_corpus, "--out", str(tmp_path / "o"),
                 "--target", str(_truncated_target(tmp_path))]) == 1
    assert "truncated or damaged" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["generate", "x", "--temperature", "-1"], "--temperature: -1: input should be greater than or equal to 0"),
    (["generate", "x", "--temperature", "nan"], "--temperature: nan: not a number"),
    (["generate", "x", "--seed", "-3"], "--seed: -3"),
    (["eval", "--temperatures", "0,-0.5"], "--temperatures: -0.5"),
    (["eval", "--num-prompts", "0"], "--num-prompts: 0: must be an integer >= 1"),
    (["bench-serve", "--concurrency", "4,0"], "--concurrency: 0"),
    (["serve", "--port", "70000"], "--port: 70000"),
    (["train", "dflash", "--out", "o", "--max-seconds", "inf"], "--max-seconds: inf: must be a finite number"),
    (["train", "dflash", "--out", "o", "--lr", "0"], "--lr: 0"),
    (["train", "dflash", "--out", "o", "--soft", "1.5"], "--soft: 1.5: must be at most 1.0"),
])
def test_numeric_flags_are_checked_as_the_spec_checks_them(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:  # argparse's own error path, with exit code 1
        main(argv)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_help_shows_defaults_and_every_flag(capsys):
    import argparse

    from draftline.api.commands import add_commands
    from draftline.core.cli import build_parser

    sub = next(a for a in build_parser(add_commands)._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            assert action.help, (name, action.dest)
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "(default: 128)" in capsys.readouterr().out  # --max-new-tokens
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--gen-batch      1024 (dflash, eagle3, gemma4_mtp)" in capsys.readouterr().out
