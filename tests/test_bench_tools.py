"""Every tool in bench/ runs on the CPU: the GPU tools through the cuda backend in Triton's
interpreter (one short prompt, a few tokens: what runs is checked, not its times), the CPU tools
as they are. trace_rounds.py is run on a served trace by tests/test_bench_serve.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore")


def _run(*argv: str) -> str:
    path = os.pathsep.join(map(str, (ROOT / "bench", ROOT)))  # this tree's package, not whichever is installed
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_user_speedup_prints_each_pass_against_none():
    out = _run("bench/user_speedup.py", "--batches", "1", "--prompts", "1", "--tokens", "3", "--methods", "eagle3",
               "--depths", "1", "--plain", "--json-schema", "specs/tiny/eval_schema.json")  # held to a grammar too
    rows = [r for r in (line.split() for line in out.splitlines()) if len(r) > 7 and r[0] == "eagle3"
            and r[3] in ("new", "again")]
    assert [r[3] for r in rows] == ["new", "again"] and all(r[7].endswith("x") for r in rows)
    assert "none free of the grammar at the same lengths" in out  # the grammar's cost


def test_identity_counts_outputs_equal_to_none():
    out = _run("bench/identity.py", "--batches", "1", "--prompts", "1", "--tokens", "3", "--methods", "gemma4_mtp",
               "--invariant", "off", "--depths", "0")
    row = next(line for line in out.splitlines() if line.startswith("gemma4_mtp"))
    assert row.split()[4:] == ["1/1", "1/1", "1/1", "1/1"]  # float32 in the interpreter: every output equal


def test_gpu_profile_and_host_parts_time_a_pass():
    out = _run("bench/gpu_profile.py", "specs/tiny-dflash.yaml", "1", "0", "--plain", "--tokens=3", "--top=3")
    assert "(dflash, plain kernels) batch 1 depth 0" in out and "us/round" in out.splitlines()[-1]
    out = _run("bench/host_parts.py", "--methods", "none", "--batch", "1", "--prompts", "1", "--tokens", "3",
               "--json-schema", "specs/tiny/eval_schema.json")  # the grammar's parts timed too
    parts = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert "none batch 1:" in out and {"machine.step", "backend.constrained.launch", "matcher.advance"} <= set(parts)


def test_prefill_kernels_and_launch_count_run_in_the_interpreter():
    out = _run("bench/prefill_kernels.py", "specs/tiny-none.yaml", "1", "--len=16")
    assert "1 prompts x 16 tokens" in out
    out = _run("bench/launch_count.py", "specs/tiny-dflash.yaml", "1", "--tokens=3")
    assert "launches a round" in out and "triton " in out


def test_block_bound_measures_parallel_drafts_against_the_target():
    out = _run("bench/block_bound.py", "--prompts", "1", "--samples", "8", "--rounds", "8", "--block", "4")
    slots = out.splitlines()[1].split(":")[1].split()
    assert len(slots) == 3 and slots[0] == "1.00"  # the first slot's marginal is the target's own law
    assert "tau bound" in out.splitlines()[2]


def test_the_gpu_scripts_parse_and_name_what_exists():
    """The shell scripts run only on a CUDA machine; here: their syntax, and every file they name."""
    for script in ("bench/open_targets.sh", "bench/width_bench.sh"):
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0
        text = (ROOT / script).read_text()
        named = {w.strip("\"'") for w in text.split() if w.startswith(("bench/", "specs/", "tests/")) and "$" not in w}
        assert named and all((ROOT / n).exists() for n in named), named
