"""Packaging: one namespace, `draftline`, built from the repository's top-level folders."""

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
