"""GPU-only kernel paths compiled for a Hopper GPU on any machine: the interpreter never runs
what a real GPU alone compiles (PDL gates, the attention's L2 prefetch), so CI at least holds
them to compiling, to PTX and a cubin for sm_90. Each compile runs in a process of its own,
without the interpreter (a compile for a GPU target leaves Triton's driver state unusable for
the interpreted tests beside it)."""

import json
import os
import subprocess
import sys

import pytest

COMPILE = r"""
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from draftline.backends.cuda import attention

kernel, constants = attention._attend_kernel, json.loads(sys.argv[1])
pointers = {"q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "slots": "*i64", "kv_len": "*i32", "table": "*i32",
            "o_part": "*fp32", "lse_part": "*fp32", "tickets": "*i32", "o": "*bf16"}
names = list(inspect.signature(kernel.fn).parameters)
signature = {n: pointers.get(n) or ("constexpr" if n in constants else "fp32" if n == "scale" else "i64")
             for n in names}
source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
try:
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
except (FileNotFoundError, RuntimeError) as exc:
    if "ptxas" in str(exc).lower():
        print(json.dumps({"skip": str(exc)}))
        sys.exit(0)
    raise
ptx = compiled.asm["ptx"]
print(json.dumps({"prefetch": "prefetch.global.L2" in ptx, "gate": "griddepcontrol.wait" in ptx,
                  "cubin": bool(compiled.asm.get("cubin"))}))
"""


@pytest.mark.parametrize("causal,page", [(True, 0), (False, 16)])  # a static cache's slots; paged KV's pages
def test_attention_with_pdl_and_its_prefetch_compiles_for_hopper(causal, page):
    """The prefetch runs before the PDL gate, on a length and slot that may be stale; it clamps
    them into the cache (attention._prefetch_split), which only a GPU build compiles."""
    constants = {"CAUSAL": causal, "SPLITS": 16, "MERGE": False, "BLOCK_M": 64, "BLOCK_N": 64, "D": 128,
                 "PRECISION": "tf32", "PDL": 1, "PREFETCH": True, "LINES": 2, "SUMMED": False,
                 "PAGE": page}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(constants)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"this Triton install cannot assemble for a GPU here: {result['skip']}")
    assert result == {"prefetch": True, "gate": True, "cubin": True}
