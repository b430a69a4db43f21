"""Packaging: one namespace, `draftline`, built from the repository's top-level folders."""

import json
import os
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
    from draftline.core.engine import RequestError
    from draftline.core.models.checkpoint import CheckpointError
    from draftline.core.models.config import ConfigError
    from draftline.core.spec import SpecError

    assert (draftline.RequestError, draftline.ConfigError, draftline.CheckpointError, draftline.SpecError) == (
        RequestError, ConfigError, CheckpointError, SpecError)
    assert dir(draftline) == sorted(draftline.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        draftline.Engin


def test_core_never_imports_the_api():
    """Layering: the API is built on core, so no module under core/ imports draftline.api (the
    server's commands live in api/commands.py; draftline/cli.py puts the two together)."""
    import ast

    offenders = []
    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[:2] == ["draftline", "api"]]
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and (node.module or "").startswith("api"):
                offenders.append(f"{path.relative_to(ROOT)}: relative import of api")
    assert offenders == []


def test_import_draftline_is_light():
    # the package's own import loads no engine code: `draftline --help` and
    # `import draftline.core` stay as light as they were
    code = (
        "import sys, draftline\n"
        "heavy = [m for m in ('torch', 'draftline.core', 'draftline.api') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# Run by an interpreter started outside the repository, with the repository off sys.path:
# only an installed draftline (CI's `pip install -e .`, or a wheel) can answer the import.
OUTSIDE = """
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
assert all(Path(p or ".").resolve() != root for p in sys.path), sys.path
try:
    import draftline
except ModuleNotFoundError:
    sys.exit("No module named draftline: it is not installed")
from draftline import Engine, SamplingParams
out = Engine.from_spec(sys.argv[2]).generate(["def add(a, b):"], SamplingParams(max_new_tokens=8))
stray = [m for m in ("core", "backends", "api") if m in sys.modules]
print(json.dumps({"output_ids": out[0].output_ids, "stray": stray}))
"""


def _outside(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    hint = " (is this checkout installed? pip install -e .)" if "No module named" in run.stderr else ""
    assert run.returncode == 0, run.stderr[-2000:] + hint
    return run


def test_python_api_from_outside_the_repository(tmp_path):
    from draftline import Engine, SamplingParams

    spec = ROOT / "specs" / "tiny-dflash.yaml"
    run = _outside([sys.executable, "-c", OUTSIDE, str(ROOT), str(spec)], tmp_path)
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["stray"] == []  # nothing imported a top-level core/backends/api
    want = Engine.from_spec(spec).generate(["def add(a, b):"], SamplingParams(max_new_tokens=8))
    assert got["output_ids"] == want[0].output_ids and len(want[0].output_ids) == 8


def test_module_and_console_script_from_outside_the_repository(tmp_path):
    spec = str(ROOT / "specs" / "tiny-dflash.yaml")
    run = _outside([sys.executable, "-m", "draftline", "validate", spec], tmp_path)
    assert "1 valid, 0 invalid" in run.stdout
    script = Path(sys.executable).parent / "draftline"
    if not script.is_file():
        pytest.skip(f"no draftline console script next to {sys.executable} (pip install -e .)")
    run = _outside([str(script), "validate", spec], tmp_path)
    assert "1 valid, 0 invalid" in run.stdout


def test_a_script_beside_a_clone_named_draftline_gets_the_package(tmp_path):
    # a clone is usually a folder named draftline; a script run from the folder that holds it
    # finds that folder first, so it must be the whole package there, not an empty namespace
    (tmp_path / "draftline").symlink_to(ROOT, target_is_directory=True)
    code = (
        "import json, draftline\n"
        "from draftline import Engine, SamplingParams\n"
        "import draftline.core.engine, draftline.cli\n"
        "print(json.dumps([draftline.core.engine.__file__, draftline.cli.__file__, Engine.__name__]))\n"
    )
    run = _outside([sys.executable, "-c", code], tmp_path)
    engine, cli, name = json.loads(run.stdout.splitlines()[-1])
    assert (Path(engine), Path(cli), name) == (ROOT / "core" / "engine.py", ROOT / "draftline" / "cli.py", "Engine")
    helped = _outside([sys.executable, "-m", "draftline", "--help"], tmp_path)
    assert "generate" in helped.stdout
