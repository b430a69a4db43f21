"""What `draftline train eagle3 | dflash` writes for the shipped tiny target holds exactly the
tensors that the real speculators package read from such a run (recorded by
tests/fixtures/speculators/trained_drafters.py --write-names in trained_names.json: there it
loaded with no missing or unexpected key and matched draftline's logits within 1e-4)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftline.core.models.eagle3 import keep_own_embedding, load_eagle3
from draftline.core.models.loader import load_dflash, load_target
from draftline.core.training.distill import DistillConfig, train_dflash
from draftline.core.training.eagle3 import Eagle3TrainConfig, train_eagle3

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests/fixtures/speculators/trained_names.json").read_text())
MICRO = dict(num_sequences=2, prompt_len=8, gen_len=8, gen_batch=2, steps=1, warmup=1, batch_size=1, eval_every=1)


def _names(folder: Path) -> list[str]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return sorted(f.keys())


@pytest.fixture(scope="module")
def tiny():
    target = load_target(ROOT / "specs/tiny/target")
    stream = torch.randint(2, target.config.vocab_size, (4000,), generator=torch.Generator().manual_seed(0))
    corpus = {"train": stream.short(), "heldout": stream[:1000].short(), "train_function_starts": torch.tensor([50])}
    return target, corpus


def test_eagle3_writes_what_speculators_read(tiny, tmp_path):
    target, corpus = tiny
    cfg = Eagle3TrainConfig(crop=8, ttt_steps=2, **MICRO)  # the default preset, as the recorded run
    train_eagle3(target, corpus, tmp_path / "e", cfg, torch.device("cpu"))
    assert _names(tmp_path / "e") == RECORDED["eagle3"]["written"]
    # speculators' converter renames the one decoder layer midlayer.* -> layers.0.*, nothing else
    renamed = sorted(n.replace("midlayer.", "layers.0.", 1) for n in RECORDED["eagle3"]["written"])
    assert renamed == RECORDED["eagle3"]["read_by_speculators"]
    head = load_eagle3(tmp_path / "e")  # the target's embedding written beside it: read, not its own
    assert not keep_own_embedding(head, target)


def test_dflash_writes_what_speculators_read(tiny, tmp_path):
    target, corpus = tiny
    train_dflash(target, corpus, tmp_path / "d", DistillConfig(anchors=2, **MICRO), torch.device("cpu"))
    assert _names(tmp_path / "d") == RECORDED["dflash"]["written"] == RECORDED["dflash"]["read_by_speculators"]
    load_dflash(tmp_path / "d")
