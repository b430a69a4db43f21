"""Packaging: one namespace, `draftline`, built from the repository's top-level folders."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"draftline.core": "core", "draftline.backends": "backends", "draftline.api": "api"}


def _setuptools_table() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_maps_each_folder_into_the_namespace():
    assert _setuptools_table()["package-dir"] == {"draftline": "draftline", **FOLDERS}


def test_pyproject_lists_every_package():
    # a mapped folder is not discovered by name, so a subpackage missing here is missing
    # from the wheel while an editable install still finds it
    found = {"draftline"}
    for name, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    assert set(_setuptools_table()["packages"]) == found


def test_public_names_are_the_core_objects():
    import draftline
    from draftline.core.engine import Engine
    from draftline.core.sampling import SamplingParams
    from draftline.core.spec import load_spec

    assert draftline.Engine is Engine and draftline.SamplingParams is SamplingParams
    assert draftline.load_spec is load_spec
    assert dir(draftline) == sorted(draftline.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        draftline.Engin


def test_import_draftline_is_light():
    # the package's own import loads no engine code: `draftline --help` and
    # `import draftline.core` stay as light as they were
    code = (
        "import sys, draftline\n"
        "heavy = [m for m in ('torch', 'draftline.core', 'draftline.api') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
