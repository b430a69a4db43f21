"""The files beside tokenizer.json that HF ``AutoTokenizer`` reads (``tokenizer_config.json``,
a chat template), written into every folder draftline trains, so transformers tokenizes as
draftline does and the chat endpoint has a template.

Without a ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``, AutoTokenizer picks a
class from config.json's model type (Qwen2Tokenizer for a qwen3 target), which splits text
with its own rules instead of tokenizer.json's; with it, tokenizer.json is used as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

CONFIG = "tokenizer_config.json"
BESIDE = ("chat_template.jinja", "special_tokens_map.json")  # copied as they are when a source folder has them
# a template for targets trained from scratch (they never saw a chat format; this one is plain text)
PLAIN_CHAT_TEMPLATE = ("{%- for message in messages %}\n{{- '# ' + message['role'] + ':\\n' + message['content'] "
                       "+ '\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n{{- '# assistant:\\n' }}\n"
                       "{%- endif %}\n")


def tokenizer_config(eos_token: str) -> dict[str, Any]:
    """A tokenizer_config.json for a tokenizer.json of draftline's (no BOS, nothing added)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": eos_token,
            "pad_token": eos_token, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "chat_template": PLAIN_CHAT_TEMPLATE}


def write_tokenizer_files(out: Path, tokenizer: Tokenizer, eos_id: int, source: Path | None = None) -> None:
    """tokenizer.json and its tokenizer_config.json into ``out``. From a ``source`` folder its
    own config and template files are kept (a tokenizer class or template it lacks is filled
    in); otherwise a config with the end-of-text token and the plain template is written."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    copy_tokenizer_files(source, out, tokenizer.id_to_token(eos_id))


def copy_tokenizer_files(source: Path | None, out: Path, eos_token: str) -> None:
    """``source``'s tokenizer_config.json (completed) and template files into ``out``; a
    generated config where ``source`` is None or has none."""
    source_config = source / CONFIG if source is not None else None
    config = tokenizer_config(eos_token)
    if source_config is not None and source_config.is_file():
        given = json.loads(source_config.read_text())
        has_template = given.get("chat_template") or (source / "chat_template.jinja").is_file()
        config = given | {"tokenizer_class": given.get("tokenizer_class") or config["tokenizer_class"]}
        if not has_template:
            config["chat_template"] = PLAIN_CHAT_TEMPLATE
    for name in BESIDE if source is not None else ():
        if (source / name).is_file() and (source / name).resolve() != (out / name).resolve():
            shutil.copy(source / name, out / name)
    (out / CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
