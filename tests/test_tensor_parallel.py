"""Tensor parallelism on the CPU: two gloo processes, each with its shard of the shipped tiny
target (heads, KV heads and the MLP width split; o_proj and down_proj all-reduced). The sharded
forward computes the whole one's logits, and the engine at TP = 2 emits TP = 1's tokens for
every method, drafting included; a rank that dies is named."""

import os
from pathlib import Path

import pytest
import torch

from draftline.core import parallel
from draftline.core.engine import Engine
from draftline.core.models.config import ConfigError
from draftline.core.models.eager import EAGER
from draftline.core.models.layers import causal_attention
from draftline.core.models.loader import load_target
from draftline.core.models.ops import Forward
from draftline.core.models.shard import ShardedOps
from draftline.core.sampling import SamplingParams
from draftline.core.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "specs" / "tiny" / "target"
IDS = [[5, 120, 33, 87, 400, 12, 9, 250, 61, 7]]
PROMPTS = ["def fibonacci(n):", "import os\nclass A:\n"]


def _logits(ids: list[list[int]], rank_shard: bool) -> torch.Tensor:
    from draftline.core.parallel import current_shard

    if rank_shard:  # this rank's slices only, each tensor sliced as it is read
        target = load_target(TARGET, current_shard(2)).float()
        ops = ShardedOps(target.reduced)
    else:
        target, ops = load_target(TARGET).float(), EAGER
    x = torch.tensor(ids)
    positions = torch.arange(x.shape[1])[None].expand_as(x)
    fwd = Forward(positions, causal_attention)
    with torch.no_grad():
        hidden, _ = target.run(ops, fwd, x)
        return target.logits(hidden)


def test_the_sharded_forward_computes_the_whole_targets_logits():
    whole = _logits(IDS, False)
    sharded = parallel.launch(2, _logits, IDS, True)
    assert torch.allclose(sharded, whole, atol=1e-4, rtol=1e-4)
    assert torch.equal(sharded.argmax(-1), whole.argmax(-1))


def _shard_sizes() -> dict[str, list[int]]:
    from draftline.core.parallel import current_shard

    return {n: list(t.shape) for n, t in load_target(TARGET, current_shard(2)).state_dict().items()}


def test_a_rank_holds_its_slices():
    sizes = parallel.launch(2, _shard_sizes)
    whole = {n: list(t.shape) for n, t in load_target(TARGET).state_dict().items()}
    assert sizes["model.layers.0.self_attn.q_proj.weight"] == [whole["model.layers.0.self_attn.q_proj.weight"][0] // 2,
                                                                256]
    assert sizes["model.layers.0.self_attn.k_proj.weight"][0] == whole["model.layers.0.self_attn.k_proj.weight"][0] // 2
    assert sizes["model.layers.0.mlp.down_proj.weight"] == [256, 384]
    assert sizes["lm_head.weight"] == whole["lm_head.weight"]  # replicated


def _spec(name: str, size: int):
    spec = load_spec(ROOT / "specs" / name)
    data = spec.model_dump(mode="json")
    data["model"]["tensor_parallel_size"] = size
    return type(spec).model_validate(data)


@pytest.mark.parametrize("name", ["tiny-dflash.yaml", "tiny-eagle3.yaml", "tiny-gemma4-mtp.yaml"])
def test_tp2_emits_tp1s_tokens_with_drafting(name):
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True), SamplingParams(max_new_tokens=24, temperature=0.8,
                                                                                  seed=7, ignore_eos=True)]
    want = Engine(_spec(name, 1), draft_policy="always").generate(PROMPTS, params)
    got = parallel.generate(_spec(name, 2), PROMPTS, params, draft_policy="always")
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert sum(c.meta_info["spec_accepted_tokens"] for c in got) > 0  # drafts were kept at TP = 2


def _die(code: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(code)
    dist.barrier()  # rank 0 waits on the dead rank in a collective


def test_a_rank_that_dies_is_named_and_the_run_ends():
    with pytest.raises(RuntimeError, match="rank 1 died"):
        parallel.launch(2, _die, 3)


def test_sizes_that_do_not_divide_and_an_engine_outside_a_launch_are_config_errors():
    with pytest.raises(ConfigError, match="start the engine through draftline.core.parallel"):
        Engine(_spec("tiny-none.yaml", 2))
    with pytest.raises(ConfigError, match=r"attention heads \(8\) do not divide by it"):
        parallel.launch(3, _engine, _spec("tiny-none.yaml", 3).model_dump(mode="json"))


def _engine(data: dict) -> None:
    from draftline.core.spec import parse_spec

    Engine(parse_spec(data))


def test_a_spec_names_a_size_that_does_not_divide_and_the_cuda_backend():
    from draftline.core.spec import check_files

    assert any("attention heads (8) do not divide" in p for p in check_files(_spec("tiny-none.yaml", 3)))
    assert check_files(_spec("tiny-none.yaml", 2)) == []
    data = _spec("tiny-none.yaml", 2).model_dump(mode="json") | {"backend": "cuda"}
    with pytest.raises(ValueError, match="runs on the reference backend"):
        type(_spec("tiny-none.yaml", 1)).model_validate(data)
