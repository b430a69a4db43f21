"""A corpus from the user's own text, tokenized by the target's own tokenizer.

Sources: text files (``.txt``, ``.md``, ``.rst``, ``.py``), JSONL files whose records carry a
``text`` field or a chat ``messages`` list, and folders of those. Chat records are rendered
with the target's chat template (``tokenizer_config.json``), so the drafter learns the text
the target sees when served; each record's prompt end (where the assistant's turn starts) is
kept, and distillation prompts end there. Records are split deterministically: one in ten
(by a hash of its text, wherever the data lives) is held out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from ..models.config import ConfigError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py"}
MIN_SPLIT_TOKENS = 256  # a split shorter than this gives too few distillation windows (64 tokens each)


@dataclass(frozen=True)
class Document:
    text: str  # the whole record as the target reads it
    prompt: str | None  # chat records: the rendered conversation up to the assistant's turn
    source: str  # file:line, for messages and the eval prompts it yields


def source_files(paths: list[str], skip: Path | None = None) -> list[Path]:
    """The files the paths name; ``skip`` (the corpus's own output folder) is left out."""
    out: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ConfigError(f"--data {path}: not found; give text files, JSONL files or folders of them")
        if path.is_dir():
            out += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | {".jsonl"}
                          and not (skip is not None and p.resolve().is_relative_to(skip.resolve())))
        else:
            out.append(path)
    if not out:
        raise ConfigError(f"--data {' '.join(paths)}: no .txt, .md, .rst, .py or .jsonl files found")
    return out


def read_documents(files: list[Path], template: ChatTemplate | None) -> list[Document]:
    docs = []
    for path in files:
        if path.suffix == ".jsonl":
            docs += _jsonl(path, template)
        else:
            try:
                docs.append(Document(path.read_text(encoding="utf-8"), None, str(path)))
            except UnicodeDecodeError:
                raise ConfigError(f"--data {path}: not UTF-8 text; convert it or leave it out") from None
    docs = [d for d in docs if d.text.strip()]
    if len(docs) < 2:
        raise ConfigError("--data: fewer than 2 non-empty records; a corpus needs records to train on and to hold out")
    return docs


def _jsonl(path: Path, template: ChatTemplate | None) -> list[Document]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc.msg}); one JSON object per line") from None
        out.append(_record(record, where, template))
    return out


def _record(record: Any, where: str, template: ChatTemplate | None) -> Document:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return Document(record["text"], None, where)
    messages = record.get("messages") if isinstance(record, dict) else None
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)):
        raise ConfigError(f"{where}: a record needs a \"text\" string or a \"messages\" list of "
                          "{\"role\": ..., \"content\": ...}")
    if template is None:
        raise ConfigError(f"{where}: a chat record, but the tokenizer folder has no chat template "
                          "(tokenizer_config.json chat_template); give --tokenizer the target's folder, or text records")
    try:
        whole = template.render(messages, add_generation_prompt=False)
        answered = messages[-1]["role"] == "assistant" and len(messages) > 1
        prompt = template.render(messages[:-1], add_generation_prompt=True) if answered else None
    except ChatTemplateError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return Document(whole, prompt if prompt and whole.startswith(prompt) else None, where)


def is_held_out(doc: Document) -> bool:
    """By the record's text: the same split wherever the data lives and whatever its files are
    called, and copies of one record hash alike (split_documents' fallbacks aside, one side)."""
    return hashlib.sha1(doc.text.encode()).digest()[0] % 10 == 0


def split_documents(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """One record in ten held out by hash; at least one either side."""
    held = [d for d in docs if is_held_out(d)] or docs[-1:]
    train = [d for d in docs if d not in held] or docs[:1]
    return train, [d for d in held if d not in train]


def eos_id(tokenizer: Any, folder: Path | None) -> int:
    """The end-of-text id: the folder's tokenizer_config eos_token, else <|endoftext|>."""
    names = []
    config = folder / "tokenizer_config.json" if folder else None
    if config is not None and config.is_file():
        token = json.loads(config.read_text()).get("eos_token")
        names.append(token.get("content") if isinstance(token, dict) else token)
    names.append("<|endoftext|>")
    for name in filter(None, names):
        if (i := tokenizer.token_to_id(name)) is not None:
            return i
    raise ConfigError(f"{folder}: the tokenizer has no end-of-text token (tokenizer_config.json eos_token); "
                      "give the target's folder with its tokenizer_config.json")


def load_template(folder: Path | None) -> ChatTemplate | None:
    return load_chat_template(folder) if folder is not None else None


def build_user_corpus(out: Path, data: list[str], tokenizer_folder: Path | None, vocab_size: int,
                      num_prompts: int) -> dict:
    """Read, split and tokenize the user's records into ``out``/corpus.pt (the layout
    build_corpus writes, prompt ends in place of function starts), with its tokenizer.json
    and held-out eval_prompts.jsonl."""
    import torch

    from ..models.tokenizer import load_tokenizer
    from ..models.tokenizer_files import write_tokenizer_files
    from .bpe import train_bpe
    from .corpus import shortfalls, write_prompts

    docs = read_documents(source_files(data, skip=out), load_template(tokenizer_folder))
    train_docs, held_docs = split_documents(docs)
    if tokenizer_folder is not None:
        try:
            tok = load_tokenizer(tokenizer_folder)
        except FileNotFoundError as exc:
            raise ConfigError(f"--tokenizer {tokenizer_folder}: {exc}") from None
    else:  # a target trained from scratch on this text: its own BPE
        tok = train_bpe([d.text for d in train_docs], vocab_size)
    eos = eos_id(tok, tokenizer_folder)
    vocab = max(tok.get_vocab_size(), config_vocab(tokenizer_folder))
    dtype = torch.int16 if vocab <= 2**15 else torch.int32
    data_out: dict[str, Any] = {"vocab_size": vocab, "eos_id": eos}
    for split, split_docs in (("train", train_docs), ("heldout", held_docs)):
        ids, ends = _flatten(tok, split_docs, eos)
        if len(ids) < MIN_SPLIT_TOKENS:
            raise ConfigError(f"--data: the {split} split has {len(ids)} tokens ({len(split_docs)} records); "
                              f"give more text (at least {MIN_SPLIT_TOKENS} tokens per split)")
        data_out[split] = torch.tensor(ids, dtype=dtype)
        data_out[f"{split}_function_starts"] = torch.tensor(ends, dtype=torch.int64)  # prompt ends
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(out, tok, eos, tokenizer_folder)  # with tokenizer_config.json and its chat template
    torch.save(data_out, out / "corpus.pt")
    prompts = _eval_prompts(tok, held_docs, num_prompts)
    write_prompts(out / "eval_prompts.jsonl", prompts)
    return {"warnings": shortfalls("records", len(held_docs), len(prompts), num_prompts), "records": len(docs), "train_records": len(train_docs), "heldout_records": len(held_docs),
            "chat_records": sum(d.prompt is not None for d in docs), "train_tokens": data_out["train"].numel(),
            "heldout_tokens": data_out["heldout"].numel(), "vocab_size": vocab,
            "tokenizer": str(tokenizer_folder or "BPE trained on the train split"),
            "bytes": (out / "corpus.pt").stat().st_size}


def _flatten(tok: Any, docs: list[Document], eos: int) -> tuple[list[int], list[int]]:
    """One token stream, end-of-text after each record, and each chat prompt's last token."""
    ids: list[int] = []
    ends: list[int] = []
    for doc in docs:
        if doc.prompt is not None:
            prompt = tok.encode(doc.prompt, add_special_tokens=False).ids
            answer = tok.encode(doc.text[len(doc.prompt):], add_special_tokens=False).ids
            ends.append(len(ids) + len(prompt) - 1)
            ids += prompt + answer + [eos]
        else:
            ids += tok.encode(doc.text, add_special_tokens=False).ids + [eos]
    return ids, ends


def _eval_prompts(tok: Any, docs: list[Document], count: int) -> list[dict]:
    """Held-out chat prompts as they are; text records' first 64 tokens."""
    out = []
    for doc in docs[:count]:
        prompt = doc.prompt or tok.decode(tok.encode(doc.text, add_special_tokens=False).ids[:64])
        out.append({"source": doc.source, "prompt": prompt})
    return out


def config_vocab(folder: Path | None) -> int:
    """The target's config.json vocab_size (often padded past the tokenizer's)."""
    config = folder / "config.json" if folder else None
    if config is None or not config.is_file():
        return 0
    return int(json.loads(config.read_text()).get("vocab_size") or 0)
