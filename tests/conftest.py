import json
import shutil
from pathlib import Path

import pytest
import torch

from draftline.backends.reference.kv import ReferenceKV
from draftline.core.spec import parse_spec

SPECS = {
    "dflash": {
        "model": {"random_init": {"preset": "tiny-qwen3", "seed": 0}},
        "speculative": {"method": "dflash", "draft": {"random_init": {"preset": "tiny-dflash", "seed": 1}},
                        "max_draft_batch": "always"},
        "backend": "reference",
        "server": {"max_batch_size": 8},
    },
}


INTERPRETED = not torch.cuda.is_available()  # the cuda backend's kernels run in Triton's interpreter


def _kernels(backend: str, model_overrides: dict) -> dict:
    """Under the interpreter a cuda spec takes the plain kernels unless the test asks for
    model.batch_invariant: the invariant forms about double an interpreted test's time, and
    they have tests of their own (test_batch_invariance.py, the trained DFlash differential
    case). On the GPU the spec's default (invariant) holds everywhere."""
    if backend == "cuda" and INTERPRETED:
        model_overrides.setdefault("batch_invariant", False)
    return model_overrides


def tiny_spec(method: dict | None = None, max_batch_size: int = 8, backend: str = "reference", **model_overrides):
    data = {**SPECS["dflash"], "server": {"max_batch_size": max_batch_size}, "backend": backend}
    data["model"] = {**data["model"], **_kernels(backend, model_overrides)}
    if method is not None:
        data["speculative"] = {"max_draft_batch": "always", **method}
    return parse_spec(data)


def respec(spec, backend: str, max_batch_size: int | None = None, **model_overrides):
    """The same spec on another backend, with model fields (device, dtype, ...) overridden."""
    data = spec.model_dump(mode="python")
    data["backend"] = backend
    data["model"].update(_kernels(backend, model_overrides))
    if max_batch_size is not None:
        data["server"]["max_batch_size"] = max_batch_size
    return type(spec).model_validate(data)


def argmax_drafts(spec):
    """The spec with its drafts the drafter's argmax (the shipped specs sample theirs from q for
    sampled requests): a seeded request's tokens then follow from its seed alone, whatever is
    drafted, whereas drafts sampled from q keep the target's law, not each token."""
    return spec.with_method({**spec.speculative.model_dump(mode="python"), "draft_sample_method": "greedy"})


@pytest.fixture(scope="module")
def engine(request):
    """The test module's SPEC as an engine (a module's own ``engine`` fixture takes precedence)."""
    from draftline.core.engine import Engine

    return Engine(request.module.SPEC)


@pytest.fixture(scope="module")
def url(request, engine):
    """A server on a loopback port serving the module's SPEC with ``engine``."""
    from draftline.api.server import background

    with background(request.module.SPEC, engine) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    """The real openai client against ``url``."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def full_forward(target, ids: torch.Tensor, taps=()):
    """Uncached causal forward over whole sequences ids [B, T] (the plainest oracle)."""
    kv = ReferenceKV()
    caches = [kv.new(target.config.num_layers) for _ in range(ids.shape[0])]
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    return target(ids, positions, kv.attention(caches, causal=True, persist=False), taps)


def z_lab_sliding_dflash(folder: Path) -> Path:
    """The speculators sliding DFlash fixture's weights (layer 0 sliding, window 3) under a
    z-lab config: the tensor names are the same; the config says layer_types at the top level."""
    src = Path(__file__).parent / "fixtures" / "speculators" / "dflash-sliding-window"
    inner = json.loads((src / "config.json").read_text())["transformer_layer_config"]
    raw = {k: v for k, v in inner.items() if k not in ("rope_parameters", "max_window_layers")}
    raw.update(architectures=["DFlashDraftModel"], rope_theta=10000.0, num_target_layers=6, block_size=4,
               dflash_config={"mask_token_id": 257, "target_layer_ids": [-1, 2, 5]})
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    shutil.copy(src / "model.safetensors", folder / "model.safetensors")
    return folder


def pytest_collection_finish(session):
    """The test modules that run kernels have loaded the Triton interpreter by now."""
    import interpreter

    interpreter.skip_nested_patches()
    interpreter.table_dtypes()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
