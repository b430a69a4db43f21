"""What `draftline train` reads, checked before any work: the device, the preset, the output
folder and the corpus (a file `draftline corpus` wrote, long enough for --seq-len). Each
problem is a ConfigError naming the flag or the file, and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .models.config import ConfigError

CORPUS_KEYS = ("train", "heldout", "vocab_size", "eos_id")


def device(requested: str):
    """The torch device of ``--device``: auto takes CUDA where torch sees it."""
    import torch

    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(requested)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {requested}: not a device; give auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {requested}: torch {torch.__version__} sees no CUDA device on this machine; "
                              "use --device cpu (or auto), or install a CUDA build of torch on a GPU machine")
        if (chosen.index or 0) >= count:
            raise ConfigError(f"--device {requested}: this machine has {count} CUDA device(s); use cuda:0..cuda:{count - 1}")
    elif chosen.type != "cpu":
        raise ConfigError(f"--device {requested}: training runs on cpu or cuda; give auto, cpu, cuda or cuda:N")
    return chosen


def preset(what: str, name: str) -> None:
    """``--preset``: a shape the command knows."""
    from .models.eagle3 import PRESETS as EAGLE3
    from .models.gemma4_mtp import PRESETS as MTP
    from .models.presets import DRAFT_PRESETS, TARGET_PRESETS

    table = {"target": TARGET_PRESETS, "dflash": DRAFT_PRESETS, "eagle3": EAGLE3, "gemma4_mtp": MTP}[what]
    if name not in table:
        raise ConfigError(f"--preset {name}: not one of the {what} presets: {', '.join(sorted(table))}")


def out_folder(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: a file is there; give a folder (new, or one to overwrite) for the checkpoint")


def corpus(folder: str, seq_len: int | None = None) -> dict[str, Any]:
    """The corpus.pt in ``folder``, whole and (for target training) longer than ``seq_len``."""
    import torch

    file = Path(folder) / "corpus.pt"
    rebuild = f"rebuild it with `draftline corpus --out {folder}`"
    if not file.is_file():
        raise ConfigError(f"{file}: not found; build it first with `draftline corpus --out {folder}`")
    try:
        data = torch.load(file)
    except Exception as exc:  # noqa: BLE001 (whatever torch.load makes of a damaged file)
        raise ConfigError(f"{file}: not a corpus `draftline corpus` wrote (torch.load: {type(exc).__name__}); "
                          f"{rebuild}") from None
    missing = [k for k in CORPUS_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise ConfigError(f"{file}: lacks {', '.join(missing)}; {rebuild}")
    shortest = min(data["train"].numel(), data["heldout"].numel())
    if seq_len is not None and seq_len + 1 >= shortest:
        raise ConfigError(f"--seq-len {seq_len}: {file} has {data['train'].numel():,} training and "
                          f"{data['heldout'].numel():,} held-out tokens; give a --seq-len below {shortest - 1} "
                          "or a larger corpus")
    return data


def same_tokenizer(corpus_folder: str, target_folder: str) -> None:
    """A drafter learns token ids: its corpus must be tokenized as its target's prompts are.
    A target folder without tokenizer.json (a bare checkpoint) is taken at its word."""
    import json

    theirs, ours = Path(target_folder) / "tokenizer.json", Path(corpus_folder) / "tokenizer.json"
    if not theirs.is_file() or not ours.is_file():
        return
    try:
        same = json.loads(theirs.read_text()).get("model") == json.loads(ours.read_text()).get("model")
    except (ValueError, UnicodeDecodeError):
        return  # a damaged file is named where it is loaded
    if not same:
        raise ConfigError(f"--data {corpus_folder}: its tokenizer.json is not --target {target_folder}'s, so the "
                          "drafter would learn other token ids; rebuild the corpus with the target's tokenizer: "
                          f"`draftline corpus --tokenizer {target_folder} --out {corpus_folder}` (add --data for your own text)")
