"""The cuda backend's staging of host values (backends/cuda/staging.py): every value arrives
intact whatever is in flight, a slab is written again only once the device has read it, and
values too large for a slab, or steps with every slab in flight, pin a buffer of their own."""

import numpy as np
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


@pytest.mark.gpu
def test_values_put_together_share_one_slab_and_arrive_intact():
    """A prefill's rows and columns go in one copy: numpy arrays and tensors of several dtypes
    and shapes, each at its own aligned place in one slab."""
    staging = Staging(torch.device("cuda"), slab_bytes=1024, slabs=2)
    torch.cuda._sleep(100_000_000)
    sent = (np.arange(15, dtype=np.int64).reshape(3, 5), np.array([0.5, 1.5, -2.0], dtype=np.float32),
            torch.tensor([[True], [False]]), np.zeros((0, 4), dtype=np.int64), torch.arange(7, dtype=torch.int32))
    kept = [np.array(v, copy=True) if isinstance(v, np.ndarray) else v.clone() for v in sent]
    moved = staging.put_many(*sent)
    assert staging.fallbacks == 0 and staging.used.count(True) == 1  # one slab, one copy
    for v in sent:
        v[...] = 0  # the host side may change at once
    torch.cuda.synchronize()
    for m, k in zip(moved, kept):
        assert m.device.type == "cuda" and tuple(m.shape) == tuple(k.shape)
        assert torch.equal(m.cpu(), torch.as_tensor(k))


def test_without_a_gpu_values_go_straight_to_the_device():
    staging = Staging(torch.device("cpu"))
    value = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(staging.put(value), value) and not staging.slabs and staging.fallbacks == 0
    ints, floats = staging.put_many(np.arange(6).reshape(2, 3), torch.tensor([1.5, 2.5]))
    assert torch.equal(ints, torch.arange(6).view(2, 3)) and torch.equal(floats, torch.tensor([1.5, 2.5]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_put_into_lands_the_values_in_the_buffer_a_graph_reads_and_nothing_past_them(device):
    """A prefill's inputs go straight into the buffer its graph was captured over: the values,
    bit for bit (floats stored in int64 places too), and the buffer past them untouched."""
    staging = Staging(torch.device(device), slab_bytes=1024, slabs=2)
    dest = torch.full((40,), -7, dtype=torch.int64, device=device)
    if device == "cuda":
        torch.cuda._sleep(100_000_000)
    sent = np.arange(30, dtype=np.int64)
    sent[10:12] = np.array([0.25, -3.5, 1e-6, 2.0], dtype=np.float32).view(np.int64)
    kept = sent.copy()
    staging.put_into(dest, sent)
    sent[:] = 0  # the host side may change at once
    assert staging.fallbacks == 0
    assert torch.equal(dest[:30].cpu(), torch.from_numpy(kept)) and (dest[30:] == -7).all()
    assert dest[10:12].view(torch.float32).cpu().tolist() == [0.25, -3.5, np.float32(1e-6).item(), 2.0]
    with pytest.raises(ValueError, match="put_into"):
        staging.put_into(dest, np.zeros(41, dtype=np.int64))
