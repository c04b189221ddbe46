"""Hand-computed checks of FedMRL's Matryoshka loss and FedL2G's guidance loss and server update."""

import math

import pytest
import torch

from fedhet.functional.guidance import clip_by_norm, guidance_loss, guidance_update
from fedhet.functional.matryoshka import matryoshka_loss, nested_prefixes


def test_nested_prefixes_are_the_leading_dimensions():
    """Widths 1 and 2 of a 3-wide representation: the first column, then the first two."""
    r = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    coarse, fine = nested_prefixes(r, [1, 2])
    assert coarse.tolist() == [[1.0], [4.0]]
    assert fine.tolist() == [[1.0, 2.0], [4.0, 5.0]]
    for bad in (0, 4):
        with pytest.raises(ValueError, match="1 <= d <= 3"):
            nested_prefixes(r, [bad])


def test_matryoshka_loss_weighs_each_granularity():
    """Logits (0, ln 3) give p(y=0) = 1/4, CE = ln 4; (0, 0) give ln 2; weights 2 and 0.5: 4.5 ln 2."""
    y = torch.tensor([0])
    coarse = torch.tensor([[0.0, math.log(3.0)]])
    fine = torch.zeros(1, 2)
    loss = matryoshka_loss([coarse, fine], y, [2.0, 0.5])
    assert loss.item() == pytest.approx(2 * math.log(4.0) + 0.5 * math.log(2.0), abs=1e-6)
    assert loss.item() == pytest.approx(4.5 * math.log(2.0), abs=1e-6)
    with pytest.raises(ValueError, match="one weight per granularity"):
        matryoshka_loss([coarse, fine], y, [1.0])


def test_guidance_loss_is_the_elementwise_mse_to_the_label_rows():
    """Targets are rows 2 and 1: differences (-1, 0) and (2, 3), squared mean (1 + 0 + 4 + 9) / 4 = 3.5."""
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    g = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]])
    assert guidance_loss(s, g, torch.tensor([2, 1])).item() == pytest.approx(3.5)


def test_clip_by_norm_scales_only_above_the_norm():
    """Norm 5: max 10 leaves it, max 1 scales by 1 / (5 + 1e-6), None leaves it."""
    grad = torch.tensor([3.0, 4.0])
    assert torch.equal(clip_by_norm(grad, 10.0), grad)
    assert torch.allclose(clip_by_norm(grad, 1.0), grad / (5.0 + 1e-6))
    assert clip_by_norm(grad, None) is grad


def test_guidance_update_averages_each_class_over_its_senders():
    """Three clients, three classes; each class's rows averaged over the clients that mark it.

    class 0: clients 1 and 2 -> ([2, 0] + [4, 2]) / 2 = [3, 1]; class 1: client 1 alone -> [4, 4]
    (client 2's unmarked [7, 7] is ignored); class 2: client 3 alone -> [1, -1]. With lr 0.5:
    guide - 0.5 * mean.
    """
    guide = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, -2.0]])
    grads = [
        torch.tensor([[2.0, 0.0], [4.0, 4.0], [9.0, 9.0]]),
        torch.tensor([[4.0, 2.0], [7.0, 7.0], [0.0, 0.0]]),
        torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, -1.0]]),
    ]
    counts = [torch.tensor([1, 1, 0]), torch.tensor([1, 0, 0]), torch.tensor([0, 0, 1])]
    new, present = guidance_update(guide, grads, counts, lr=0.5, max_norm=None)
    assert torch.allclose(new, torch.tensor([[-0.5, 0.5], [-2.0, -2.0], [1.5, -1.5]]))
    assert present.tolist() == [True, True, True]
    # clipped at norm 1: the mean's norm is sqrt(9 + 1 + 16 + 16 + 1 + 1) = sqrt(44)
    clipped, _ = guidance_update(guide, grads, counts, lr=0.5, max_norm=1.0)
    scale = 1.0 / (math.sqrt(44.0) + 1e-6)
    assert clipped[0].tolist() == pytest.approx([1 - 0.5 * 3 * scale, 1 - 0.5 * 1 * scale], abs=1e-6)
    # a class nobody marks keeps its row
    _, present = guidance_update(guide, grads[:2], counts[:2], lr=0.5, max_norm=None)
    assert present.tolist() == [True, True, False]


def test_clip_by_norm_adds_its_epsilon_to_the_norm():
    """Norm 5 clipped to 1: scaled by exactly 1 / (5 + 1e-6) in float32 (not 1 / (5 - 1e-6))."""
    grad = torch.tensor([3.0, 4.0])
    assert torch.equal(clip_by_norm(grad, 1.0), grad * (1.0 / (grad.norm() + 1e-6)))


def test_guidance_update_keeps_the_guides_dtype():
    """float64 client gradients step a float32 guidance that stays float32."""
    new, _ = guidance_update(torch.zeros(1, 1), [torch.ones(1, 1, dtype=torch.float64)], [torch.tensor([1])], 0.5, 10.0)
    assert new.dtype == torch.float32 and new.tolist() == [[-0.5]]
