"""Every shipped spec validates; every deliberately broken spec fails naming its field."""

from pathlib import Path

import pytest

from draftline.cli import main
from draftline.core.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "specs").rglob("*.yaml"))
BROKEN = sorted((ROOT / "tests" / "broken_specs").glob("*.yaml"))


def test_there_are_specs():
    assert len(SHIPPED) >= 5 and len(BROKEN) >= 20


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_spec_validates(path):
    load_spec(path)


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.name)
def test_broken_spec_fails_naming_the_field(path):
    expect = path.read_text().splitlines()[0].removeprefix("# expect: ")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert any(expect in m for m in info.value.messages), info.value.messages


def test_validate_command_exit_codes(capsys):
    assert main(["validate", str(ROOT / "specs")]) == 0
    assert main(["validate", str(ROOT / "tests" / "broken_specs")]) == 1
    out = capsys.readouterr().out
    assert f"0 valid, {len(BROKEN)} invalid" in out and "block_size" in out


def test_check_files_reports_missing_checkpoint(capsys, tmp_path):
    spec = ROOT / "specs" / "qwen3-8b-dflash-b16.yaml"
    assert main(["validate", str(spec)]) == 0
    assert main(["validate", "--check-files", str(spec)]) == 1
    assert "config.json: file not found" in capsys.readouterr().out


def test_check_files_reads_real_configs(tmp_path):
    """--check-files cross-checks a checkpoint's config.json against the drafter's."""
    import json

    from draftline.core.models.presets import TARGET_PRESETS
    from draftline.core.spec import check_files

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({**TARGET_PRESETS["tiny-qwen3"], "num_hidden_layers": 3}))
    (tmp_path / "s.yaml").write_text(
        "model: {path: t}\nspeculative: {method: dflash, draft: {random_init: {preset: tiny-dflash}}}\n"
    )
    problems = check_files(load_spec(tmp_path / "s.yaml"))
    assert any("target_layer_ids: [3] outside the target's layers 0..2" in p for p in problems)
