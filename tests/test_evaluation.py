"""`draftline eval` on a few prompts: aggregates, the temperature-0 lossless check, the plot."""

import json
from pathlib import Path

from draftline.cli import main
from draftline.core.training.corpus import write_prompts

ROOT = Path(__file__).resolve().parent.parent


def test_eval_json_and_plot(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, [{"module": "m", "name": "f", "prompt": t} for t in ("def f(x):\n", "class A:\n", "x = 1\n")])
    png = tmp_path / "eval.png"
    argv = ["eval", str(ROOT / "specs" / "tiny-dflash.yaml"), "--prompts", str(prompts), "--max-new-tokens", "12",
            "--json", "--plot", str(png)]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out.splitlines()[0])
    greedy, sampled = results
    assert greedy["temperature"] == 0.0 and greedy["lossless_check"] == "3/3 identical"
    assert greedy["tokens"] == 36 and greedy["rounds"] > 0 and len(greedy["accept_per_pos"]) == 15
    assert 1.0 <= greedy["tau"] <= 16 and greedy["speedup"] > 0
    assert sampled["temperature"] == 1.0 and sampled["lossless_check"].startswith("n/a")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shipped_prompts_are_heldout_function_starts():
    lines = (ROOT / "specs" / "tiny" / "eval_prompts.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) >= 100
    from draftline.core.training.corpus import is_held_out

    assert all(is_held_out(r["module"]) and r["prompt"].lstrip().startswith(("def ", "async def ")) for r in rows)


def test_shipped_checkpoints_fit_the_size_budget():
    files = [p for p in (ROOT / "specs" / "tiny").rglob("*") if p.is_file()]
    assert all(p.stat().st_size < 15 * 2**20 for p in files)
    assert sum(p.stat().st_size for p in files) < 30 * 2**20
