"""How tensors travel between Ray processes: NumPy arrays where possible, exact and writable on arrival.

Pure functions of :mod:`fedhet.federation.ray_executor` (Ray itself is not needed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhet.federation.ray_executor import tensor_from_transport, tensor_to_transport


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_numpy_dtypes_travel_as_arrays_and_arrive_exact(dtype):
    """Every dtype NumPy holds goes as an array and comes back with its dtype, shape and values."""
    tensor = (torch.arange(12).reshape(3, 4) % 5).to(dtype)
    kind, data = tensor_to_transport(tensor)
    assert kind == "numpy" and isinstance(data, np.ndarray)
    back = tensor_from_transport((kind, data))
    assert back.dtype == dtype and back.shape == (3, 4) and torch.equal(back, tensor)


def test_arrival_is_a_writable_copy_not_a_view_of_the_buffer():
    """Optimizers update loaded buffers in place: the arrived tensor must own its memory."""
    data = np.arange(6, dtype=np.float32)
    data.flags.writeable = False  # what Ray's zero-copy deserialisation hands over
    back = tensor_from_transport(("numpy", data))
    back.add_(1.0)
    assert data.tolist() == [0, 1, 2, 3, 4, 5] and back.tolist() == [1, 2, 3, 4, 5, 6]


def test_views_send_only_their_elements():
    """A strided view sends its 5 elements, not the 100 of its storage; 0-d tensors travel too."""
    base = torch.arange(100, dtype=torch.float32)
    view = base[10:20:2]
    kind, data = tensor_to_transport(view)
    assert kind == "numpy" and data.size == 5
    assert torch.equal(tensor_from_transport((kind, data)), torch.tensor([10.0, 12.0, 14.0, 16.0, 18.0]))
    zero_dim = torch.tensor(3.5)
    assert tensor_from_transport(tensor_to_transport(zero_dim)).item() == 3.5


def test_tensors_numpy_cannot_hold_keep_torch_pickling():
    """bfloat16 and tensors requiring grad fall back to PyTorch's pickling, unchanged."""
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    grad = torch.ones(2, requires_grad=True)
    for tensor in (bf16, grad):
        kind, _ = packed = tensor_to_transport(tensor)
        back = tensor_from_transport(packed)
        assert kind == "pickle" and back.dtype == tensor.dtype and back.requires_grad == tensor.requires_grad
        assert torch.equal(back.detach(), tensor.detach())
