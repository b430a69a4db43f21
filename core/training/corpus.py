"""A Python-source corpus from the running interpreter's standard library, no downloads.

Files are grouped by top-level module and split deterministically: a module is held out when
the first byte of sha1(name) is divisible by 10, so held-out modules are never trained on.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import json
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

# Generated tables and bundled data say little about how Python is written.
EXCLUDED_TOP = {"pydoc_data", "encodings", "site-packages"}
EXCLUDED_PARTS = {"site-packages", "__pycache__"}


@dataclass(frozen=True)
class Split:
    train: dict[str, list[Path]]  # module -> files
    heldout: dict[str, list[Path]]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(module: str) -> bool:
    return hashlib.sha1(module.encode()).digest()[0] % 10 == 0


def split_stdlib(root: Path | None = None) -> Split:
    root = root or stdlib_root()
    modules: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        top = rel.parts[0].removesuffix(".py")
        if top in EXCLUDED_TOP or EXCLUDED_PARTS & set(rel.parts):
            continue
        modules.setdefault(top, []).append(path)
    train = {m: f for m, f in modules.items() if not is_held_out(m)}
    heldout = {m: f for m, f in modules.items() if is_held_out(m)}
    return Split(train=train, heldout=heldout)


def read_sources(modules: dict[str, list[Path]]) -> list[str]:
    out = []
    for files in modules.values():
        for path in files:
            try:
                out.append(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue  # a handful of stdlib files are not UTF-8 text; skip them
    return out


def function_prompts(modules: dict[str, list[Path]], count: int, max_chars: int = 400) -> list[dict]:
    """Function signatures plus the first line of their bodies, dedented, chosen by a hash."""
    found = []
    for module, files in modules.items():
        for path in files:
            try:
                source = path.read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (UnicodeDecodeError, SyntaxError, OSError):
                continue
            lines = source.splitlines()
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) >= 2:
                    first = node.body[0]
                    if first.lineno <= node.lineno:
                        continue  # a one-line def has no body to continue
                    text = textwrap.dedent("\n".join(lines[node.lineno - 1 : first.lineno])) + "\n"
                    if 30 <= len(text) <= max_chars:
                        key = hashlib.sha1(f"{module}:{path.name}:{node.lineno}".encode()).hexdigest()
                        found.append({"module": module, "name": node.name, "prompt": text, "key": key})
    found.sort(key=lambda d: d["key"])
    return [{k: d[k] for k in ("module", "name", "prompt")} for d in found[:count]]


def function_starts(source: str) -> list[int]:
    """Character offsets just past each function's signature and first body line."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    line_ends = [i + 1 for i, ch in enumerate(source) if ch == "\n"]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body[0].lineno > node.lineno:
            line = node.body[0].lineno  # 1-based; its end is line_ends[line - 1]
            if line - 1 < len(line_ends):
                out.append(line_ends[line - 1])
    return sorted(out)


# fewer held-out records than this, and a held-out figure rests on too little text to say much
FEW_HELDOUT = 10


def shortfalls(what: str, held: int, prompts: int, asked: int) -> list[str]:
    """Warnings, logged and returned, where the held-out split is thin or gave fewer
    evaluation prompts than asked: ``held`` held-out records (modules, or your records)."""
    import structlog

    out = []
    if held < FEW_HELDOUT:
        out.append(f"only {held} {what} held out (one in ten, by hash): held-out loss and tau rest on little "
                   "text; give more data")
    if prompts < asked:
        out.append(f"wrote {prompts} evaluation prompts of the {asked} asked (--prompts): the held-out {what} "
                   "hold no more; give more data, or ask for fewer")
    for message in out:
        structlog.get_logger("draftline.train").warning("corpus.shortfall", message=message)
    return out


def write_prompts(path: Path, prompts: list[dict]) -> None:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))


def read_prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]


def build_corpus(out: Path, vocab_size: int, num_prompts: int = 120, tokenizer_folder: Path | None = None) -> dict:
    """Train the tokenizer on the train split (or take ``tokenizer_folder``'s: a target's, whose
    drafters are to be trained on this interpreter's library), tokenize both splits, pick
    held-out prompts."""
    import torch

    from ..models.tokenizer import load_tokenizer
    from ..models.tokenizer_files import write_tokenizer_files
    from .bpe import train_bpe
    from .documents import config_vocab, eos_id

    out.mkdir(parents=True, exist_ok=True)
    split = split_stdlib()
    train_texts, heldout_texts = read_sources(split.train), read_sources(split.heldout)
    tok = train_bpe(train_texts, vocab_size) if tokenizer_folder is None else load_tokenizer(tokenizer_folder)
    eos = eos_id(tok, tokenizer_folder)
    vocab = max(tok.get_vocab_size(), config_vocab(tokenizer_folder))
    dtype = torch.int16 if vocab <= 2**15 else torch.int32  # a target's tokenizer may pass int16's ids
    write_tokenizer_files(out, tok, eos, tokenizer_folder)  # tokenizer.json and what HF AutoTokenizer reads beside it

    def flat(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token stream with end-of-text between files, and each function start's last token."""
        ids: list[int] = []
        starts: list[int] = []
        for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
            token_starts = [a for a, _ in enc.offsets]
            starts += [len(ids) + bisect.bisect_left(token_starts, c) - 1 for c in function_starts(text)]
            ids += enc.ids + [eos]
        return torch.tensor(ids, dtype=dtype), torch.tensor(starts, dtype=torch.int64)

    train, train_fn = flat(train_texts)
    heldout, heldout_fn = flat(heldout_texts)
    data = {"train": train, "heldout": heldout, "train_function_starts": train_fn,
            "heldout_function_starts": heldout_fn, "vocab_size": vocab, "eos_id": eos}
    for name, modules in (("train", split.train), ("heldout", split.heldout)):  # bare prompts, as served
        texts = [p["prompt"] for p in function_prompts(modules, 50000)]
        encoded = tok.encode_batch(texts, add_special_tokens=False)
        data[f"{name}_prompts"] = [torch.tensor(e.ids[:64], dtype=dtype) for e in encoded]
    torch.save(data, out / "corpus.pt")
    prompts = function_prompts(split.heldout, num_prompts)
    write_prompts(out / "eval_prompts.jsonl", prompts)
    return {
        "warnings": shortfalls("modules", len(split.heldout), len(prompts), num_prompts),
        "train_modules": len(split.train),
        "heldout_modules": sorted(split.heldout),
        "train_tokens": data["train"].numel(),
        "heldout_tokens": data["heldout"].numel(),
        "train_function_starts": train_fn.numel(),
        "vocab_size": data["vocab_size"],
        "bytes": (out / "corpus.pt").stat().st_size,
    }
