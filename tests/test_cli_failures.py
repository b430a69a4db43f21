"""Every broken input the CLI meets is one line naming the file or flag and the fix, exit 1, no
traceback (tests/broken_inputs.py lists the 22); --debug adds the traceback. In-process for
speed, and a few through the real `python -m draftline` process."""

import subprocess
import sys

import pytest

import broken_inputs
from draftline.cli import main


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return {name: (argv, needle) for name, argv, needle in broken_inputs.build(tmp_path_factory.mktemp("broken"))}




def test_there_are_22(cases):
    assert len(cases) == 22


@pytest.mark.parametrize("index", range(22))
def test_each_is_one_line_and_exit_1(cases, capsys, index):
    name = list(cases)[index]
    argv, needle = cases[name]
    assert main(argv) == 1, name
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "[info" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (name, err[-1500:])
    assert "Traceback" not in err


def test_debug_shows_the_traceback(cases, capsys):
    argv, _ = cases["generate with a broken hidden"]
    assert main([*argv, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("name", ["eval --prompts binary JSONL", "serve with a corrupt tokenizer.json"])
def test_as_a_process(cases, name):
    argv, needle = cases[name]
    run = subprocess.run([sys.executable, "-m", "draftline", *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip() and "[info" not in line]
    assert len(lines) == 1 and needle in lines[0], run.stderr[-1500:]
