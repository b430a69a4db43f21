"""Broken files and the `draftline` invocations that meet them: each must exit 1 with one
line naming the file or field and the fix, and no traceback. Used by tests/test_cli_failures.py
(in-process, and a few as real processes) and tests/hostile_clients.py (all as processes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "specs" / "tiny" / "target"
BINARY = bytes(range(256)) * 8


def _target(tmp: Path, name: str, edit) -> Path:
    """A copy of the shipped tiny target with one file broken by ``edit(folder)``, and a spec for it."""
    folder = tmp / name
    shutil.copytree(TARGET, folder)
    edit(folder)
    spec = tmp / f"{name}.yaml"
    spec.write_text(f"model: {{path: {folder}}}\nspeculative: {{method: none}}\nbackend: reference\n")
    return spec


def _config(folder: Path, **fields) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def _tokenizer_config(folder: Path, **fields) -> None:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def build(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(name, argv, a fragment the message must contain) for each invocation, its files under ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    prompts = {"malformed": "{not json\n", "empty": "", "wrong-field": '{"text": "def f():"}\n'}
    files = {}
    for kind, text in prompts.items():
        files[kind] = tmp / f"{kind}.jsonl"
        files[kind].write_text(text)
    files["binary"] = tmp / "binary.jsonl"
    files["binary"].write_bytes(BINARY)
    (tmp / "binary.yaml").write_bytes(BINARY)
    corrupt = tmp / "corrupt-corpus"
    corrupt.mkdir(exist_ok=True)
    (corrupt / "corpus.pt").write_bytes(BINARY)
    (corrupt / "tokenizer.json").write_bytes((TARGET / "tokenizer.json").read_bytes())
    small = tmp / "small-corpus"
    small.mkdir(exist_ok=True)
    _small_corpus(small)
    (tmp / "a-file").write_text("not a folder")
    texts = tmp / "texts"
    texts.mkdir(exist_ok=True)
    for i in range(4):
        (texts / f"{i}.txt").write_text(f"def f{i}(x):\n    return x\n" * 20)
    bad_tok = tmp / "bad-tokenizer"
    bad_tok.mkdir(exist_ok=True)
    (bad_tok / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    specs = {
        "tokenizer": _target(tmp, "t-tokenizer", lambda f: (f / "tokenizer.json").write_text("{\"model\": 5")),
        "hidden": _target(tmp, "t-hidden", lambda f: _config(f, hidden_size="big")),
        "tok-config": _target(tmp, "t-tok-config", lambda f: (f / "tokenizer_config.json").write_text("{nope")),
        "template": _target(tmp, "t-template", lambda f: _tokenizer_config(f, chat_template="{% if %}")),
    }
    t = str(TARGET)
    out = [(f"eval --prompts {k} JSONL", ["eval", "--prompts", str(files[k]), "--num-prompts", "1"], files[k].name)
           for k in ("malformed", "empty", "wrong-field", "binary")]
    out += [
        ("generate --spec on a binary file", ["generate", "--spec", str(tmp / "binary.yaml"), "x"], "binary.yaml"),
        ("train target --data corrupt corpus.pt", ["train", "target", "--data", str(corrupt), "--out", str(tmp / "o1")],
         "corpus.pt"),
        ("train dflash --data corrupt corpus.pt", ["train", "dflash", "--data", str(corrupt), "--target", t,
                                                   "--out", str(tmp / "o2")], "corpus.pt"),
        ("train target --device cuda on CPU torch", ["train", "target", "--data", str(small), "--out", str(tmp / "o3"),
                                                     "--device", "cuda"], "--device"),
        ("train dflash --device cuda on CPU torch", ["train", "dflash", "--data", str(small), "--target", t,
                                                     "--out", str(tmp / "o4"), "--device", "cuda:0"], "--device"),
        ("train target --preset nosuchpreset", ["train", "target", "--data", str(small), "--out", str(tmp / "o5"),
                                                "--preset", "nosuchpreset"], "--preset"),
        ("train eagle3 --preset nosuchpreset", ["train", "eagle3", "--data", str(small), "--target", t,
                                                "--out", str(tmp / "o6"), "--preset", "nosuchpreset"], "--preset"),
        ("train target --out an existing file", ["train", "target", "--data", str(small), "--out", str(tmp / "a-file")],
         "--out"),
        ("train target --seq-len past the corpus", ["train", "target", "--data", str(small), "--out", str(tmp / "o7"),
                                                    "--seq-len", "5000"], "--seq-len"),
        ("corpus --tokenizer with a corrupt tokenizer", ["corpus", "--data", str(texts), "--tokenizer",
                                                         str(bad_tok), "--out", str(tmp / "o8")], "tokenizer.json"),
    ]
    for kind, needle in (("tokenizer", "tokenizer.json"), ("hidden", "hidden_size"),
                         ("tok-config", "tokenizer_config.json"), ("template", "chat_template")):
        out.append((f"generate with a broken {kind}", ["generate", "--spec", str(specs[kind]), "x"], needle))
    out += [
        ("serve with a corrupt tokenizer.json", ["serve", "--spec", str(specs["tokenizer"])], "tokenizer.json"),
        ("explain with hidden_size 'big'", ["explain", str(specs["hidden"])], "hidden_size"),
        ("train dflash --target with hidden_size 'big'", ["train", "dflash", "--data", str(small), "--target",
                                                          str(specs["hidden"].with_suffix("")), "--out",
                                                          str(tmp / "o9")], "hidden_size"),
        ("eval with an invalid tokenizer_config.json", ["eval", str(specs["tok-config"]), "--num-prompts", "1"],
         "tokenizer_config.json"),
    ]
    return out


def _small_corpus(folder: Path) -> None:
    import torch

    ids = torch.arange(200) % 50
    torch.save({"train": ids, "heldout": ids[:100], "vocab_size": 4096, "eos_id": 0}, folder / "corpus.pt")
    (folder / "tokenizer.json").write_bytes((TARGET / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_bytes((TARGET / "tokenizer_config.json").read_bytes())
