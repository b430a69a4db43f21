"""On a CUDA device: the reference backend there gives the CPU's greedy tokens (model code is
device-agnostic), and training runs its bf16 autocast path."""

import pytest
import torch

from conftest import tiny_spec
from core.engine import Engine
from core.sampling import SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = ["def fibonacci(n):", "x", "import os\nimport sys\n\nclass Config:\n", "hello world"]
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("method", [{"method": "none"}, None], ids=["none", "dflash"])
def test_reference_on_cuda_matches_cpu(method):
    cpu = Engine(tiny_spec(method, device="cpu"))
    gpu = Engine(tiny_spec(method, device="cuda"))
    assert gpu.device.type == "cuda"
    got = [c.output_ids for c in gpu.generate(PROMPTS, GREEDY)]
    assert got == [c.output_ids for c in cpu.generate(PROMPTS, GREEDY)]


def test_training_step_on_cuda(tmp_path):
    from core.methods.dflash import BlockBatch, training_loss
    from core.models.loader import random_dflash, random_target
    from core.training.loop import autocast

    dev = torch.device("cuda")
    target, drafter = random_target("tiny-qwen3", 0).to(dev), random_dflash("tiny-dflash", 1).to(dev)
    tokens = torch.randint(0, 256, (2, 64), device=dev)
    anchors = torch.tensor([[3, 20, 40], [1, 10, 47]], device=dev)
    with autocast(dev):
        loss, correct = training_loss(drafter, target, BlockBatch(tokens, anchors), mask_token_id=257)
    loss.backward()
    assert torch.isfinite(loss) and correct.shape == (2, 3, 15)
    assert drafter.fc.weight.grad is not None and torch.isfinite(drafter.fc.weight.grad).all()
