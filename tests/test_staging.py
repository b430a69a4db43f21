"""The cuda backend's staging of host values (backends/cuda/staging.py): every value arrives
intact whatever is in flight, a slab is written again only once the device has read it, and
values too large for a slab, or steps with every slab in flight, pin a buffer of their own."""

import pytest
import torch

from draftline.backends.cuda.staging import Staging


@pytest.mark.gpu
def test_values_arrive_intact_while_the_device_is_busy_and_slabs_are_reused_once_read():
    device = torch.device("cuda")
    staging = Staging(device, slab_bytes=1024, slabs=4)
    torch.cuda._sleep(200_000_000)  # the stream busy for a while: no slab's copy can be done
    sent = [torch.arange(i, i + 8 * (i + 1), dtype=torch.int64) for i in range(6)] + [torch.ones(300, dtype=torch.int64)]
    moved = [staging.put(t) for t in sent]
    for t in sent:  # the host side may change at once: what was sent is what arrives
        t.zero_()
    assert staging.fallbacks == 3  # two past the four slabs, and the one over a slab's size
    torch.cuda.synchronize()
    for i, m in enumerate(moved[:6]):
        assert torch.equal(m.cpu(), torch.arange(i, i + 8 * (i + 1), dtype=torch.int64))
    assert torch.equal(moved[6].cpu(), torch.ones(300, dtype=torch.int64))
    torch.cuda._sleep(200_000_000)
    again = [staging.put(torch.full((4,), k, dtype=torch.int32)) for k in range(8)]  # the slabs read: reused in turn, then in flight again
    torch.cuda.synchronize()
    assert staging.fallbacks == 3 + 4  # the first four reuse the slabs; the next four find them in flight
    assert all(torch.equal(a.cpu(), torch.full((4,), k, dtype=torch.int32)) for k, a in enumerate(again))


def test_without_a_gpu_values_go_straight_to_the_device():
    staging = Staging(torch.device("cpu"))
    value = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(staging.put(value), value) and not staging.slabs and staging.fallbacks == 0
