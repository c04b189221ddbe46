"""FedMatch (adapted): hand-computed consistency + pseudo-label loss with the pseudo-label branch firing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import FedMatch
from fedhet.algorithms import fedmatch as fedmatch_module
from fedhet.algorithms.fedmatch import Cutout
from fedhet.errors import ConfigError
from tests.algorithms.helpers import (
    TinyLinear,
    collaborate,
    first_images,
    public_batches,
    public_clients,
    train_mode_logits,
)

# x = I: client i's logits are the columns of its head. Clients 0 and 1 are confident (6 I, 4 I),
# so client 2's helpers agree above the 0.85 threshold on both samples; clients 0 and 1 have client 2
# (logits [[0, 2], [2, 0]]) among their helpers, whose disagreement keeps them below it.
HEADS = [6 * torch.eye(2), 4 * torch.eye(2), torch.tensor([[0.0, 2.0], [2.0, 0.0]])]


@pytest.fixture
def pseudo_labels_fired(monkeypatch):
    """Records, per call of the pseudo-label loss, how many samples carried a pseudo-label."""
    counts: list[int] = []
    original = fedmatch_module.masked_pseudo_label_loss

    def spy(logits, labels, mask):
        counts.append(int(mask.sum()))
        return original(logits, labels, mask)

    monkeypatch.setattr(fedmatch_module, "masked_pseudo_label_loss", spy)
    return counts


def _kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(logits)) per row, averaged (plain torch)."""
    return (target * (target.log() - torch.log_softmax(logits, 1))).sum(1).mean()


def test_fedmatch_losses_by_hand_with_pseudo_labels_firing(pseudo_labels_fired):
    """Consistency KL to the helpers' mean prediction plus B-normalised CE on confident helper labels (strong view)."""
    algorithm = FedMatch(threshold=0.85)
    clients = [algorithm.build_client(TinyLinear(head=head.clone()), 2) for head in HEADS]
    phase = algorithm.build_collaborative_phase(clients)
    phase.strong_view = lambda x: x.flip(1)  # a known "strong" view: the two features swapped
    losses = phase.collaborative_losses(torch.eye(2))
    assert pseudo_labels_fired == [0, 0, 2]  # only client 2's helpers are confident, on both samples
    probs = [torch.softmax(head.T, 1) for head in HEADS]
    helpers_2 = (probs[0] + probs[1]) / 2  # [[0.9898, 0.0102], [0.0102, 0.9898]] -> labels (0, 1)
    assert bool((helpers_2.max(1).values > 0.85).all())
    # strong view of client 2: swapped inputs give logits [2, 0] (label 0) and [0, 2] (label 1): CE log(1 + e^-2) each
    pseudo = 2 * math.log1p(math.exp(-2.0)) / 2
    assert losses[2].item() == pytest.approx(_kl(helpers_2, HEADS[2].T).item() + pseudo, rel=1e-5)
    helpers_0 = (probs[1] + probs[2]) / 2
    assert losses[0].item() == pytest.approx(_kl(helpers_0, HEADS[0].T).item(), rel=1e-5)  # no pseudo-label


def test_fedmatch_loss_weights_by_hand(pseudo_labels_fired):
    """consistency_weight and pseudo_label_weight scale their own terms (0.5 and 2 here)."""
    algorithm = FedMatch(threshold=0.85, consistency_weight=0.5, pseudo_label_weight=2.0)
    clients = [algorithm.build_client(TinyLinear(head=head.clone()), 2) for head in HEADS]
    phase = algorithm.build_collaborative_phase(clients)
    phase.strong_view = lambda x: x.flip(1)
    loss = phase.collaborative_losses(torch.eye(2))[2]
    probs = [torch.softmax(head.T, 1) for head in HEADS]
    expected = 0.5 * _kl((probs[0] + probs[1]) / 2, HEADS[2].T).item() + 2.0 * math.log1p(math.exp(-2.0))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert sum(pseudo_labels_fired) == 2


def test_fedmatch_pseudo_label_branch_fires_in_a_real_collaborative_fit(pseudo_labels_fired):
    """With confident helpers the real strong view's pseudo-label CE runs for every client and changes the step."""
    algorithm = FedMatch()

    def confident_clients():
        clients = public_clients(algorithm)
        for client in clients:  # every model predicts class 3 with near certainty
            with torch.no_grad():
                client.model.head.bias.copy_(10.0 * F.one_hot(torch.tensor(3), 10).float())
        return clients

    clients = collaborate(algorithm, confident_clients(), public_batches()).clients
    assert pseudo_labels_fired == [8, 8, 8]  # all 8 public images of the batch, for each of the 3 clients
    without = collaborate(FedMatch(pseudo_label_weight=0.0), confident_clients(), public_batches()).clients
    assert len(pseudo_labels_fired) == 3  # the branch is skipped when its weight is 0
    moved = [not torch.equal(a.model.head.weight, b.model.head.weight) for a, b in zip(clients, without, strict=True)]
    assert all(moved)


def test_fedmatch_strong_view_is_seeded_and_changes_the_batch():
    """The strong view draws from the global RNG (seeded by the loop): same seed, same view; it alters the images."""
    phase = FedMatch().build_collaborative_phase(public_clients(FedMatch()))
    x = first_images(public_batches())
    torch.manual_seed(1)
    first = phase.strong_view(x)
    torch.manual_seed(1)
    second = phase.strong_view(x)
    assert first.shape == x.shape and torch.equal(first, second) and not torch.equal(first, x)


def test_fedmatch_a_collaborative_step_moves_every_client_towards_its_helpers():
    """After a collaborative step every client's KL to its (fixed) helpers' mean prediction shrank."""
    algorithm = FedMatch()
    clients = public_clients(algorithm)
    batches = public_batches()
    x = first_images(batches)
    before = train_mode_logits(clients, x)
    probs = [F.softmax(z, 1) for z in before]
    helpers = [torch.stack([p for j, p in enumerate(probs) if j != i]).mean(0) for i in range(len(probs))]
    collaborate(algorithm, clients, batches)
    after = train_mode_logits(clients, x)
    for i in range(len(clients)):
        assert _kl(helpers[i], after[i]) < _kl(helpers[i], before[i]), f"client {i} did not move towards its helpers"


def test_cutout_zeroes_one_square_per_image():
    """Cutout(4) zeroes one 5 x 5 window per image, clipped at the border (between 9 and 25 pixels)."""
    images = torch.ones(2, 1, 8, 8)
    out = Cutout(4)(images, torch.Generator().manual_seed(0))
    zeroed = (out == 0).sum(dim=(1, 2, 3))
    # a 5 x 5 window (|offset| <= 2) clipped at the border: between 3 x 3 and 5 x 5 pixels
    assert all(9 <= int(n) <= 25 for n in zeroed)


def test_fedmatch_invalid_hyperparameters_fail_in_one_line():
    """A threshold outside [0, 1) or a negative loss weight is a configuration error."""
    with pytest.raises(ConfigError, match="threshold"):
        FedMatch(threshold=1.5)
    with pytest.raises(ConfigError, match="weight"):
        FedMatch(consistency_weight=-1.0)


def test_fedmatch_local_loss_is_cross_entropy_by_hand():
    """After the public phase FedMatch trains on plain cross-entropy: log(1 + e^-1) for logits [1, 0], class 0."""
    client = FedMatch().build_client(TinyLinear(), 2)
    loss = client.local_loss((torch.tensor([[1.0, 0.0]]), torch.tensor([0])))
    assert loss.item() == pytest.approx(0.313262, abs=1e-6)
    assert client.make_upload([]) is None and FedMatch().build_server().download_for(0) is None


@pytest.mark.parametrize("size", [1, 3, 4])
def test_cutout_zeroes_the_window_around_centres_drawn_from_the_generator(size):
    """Row and column centres are drawn in that order from the generator; ``|offset| <= size // 2`` is zeroed."""
    images = torch.arange(1.0, 1.0 + 3 * 7 * 6).reshape(3, 1, 7, 6)
    out = Cutout(size)(images, torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(5)
    centre_y = torch.randint(0, 7, (3,), generator=generator)
    centre_x = torch.randint(0, 6, (3,), generator=generator)
    expected = images.clone()
    half = size // 2
    for b in range(3):
        for r in range(7):
            for c in range(6):
                if abs(r - int(centre_y[b])) <= half and abs(c - int(centre_x[b])) <= half:
                    expected[b, 0, r, c] = 0.0
    assert torch.equal(out, expected)
    one = Cutout(size)(images[:1], torch.Generator().manual_seed(5))
    assert int((one == 0).sum()) >= 1  # a batch of one is cut too


def test_cutout_of_size_zero_or_an_empty_batch_changes_nothing():
    """Size 0 leaves images untouched; an empty batch stays empty; a negative size is refused by value."""
    images = torch.ones(2, 1, 4, 4)
    assert Cutout(0)(images, torch.Generator().manual_seed(0)) is images
    assert Cutout(2)(torch.ones(0, 1, 4, 4), torch.Generator().manual_seed(0)).shape == (0, 1, 4, 4)
    with pytest.raises(ValueError) as error:
        Cutout(-1)
    assert str(error.value) == "cutout size must be >= 0, got -1"


@pytest.mark.parametrize(("image_size", "padding", "cutout"), [(8, 1, 4), (32, 4, 16)])
def test_fedmatch_strong_augment_pads_by_an_eighth_and_cuts_half(image_size, padding, cutout):
    """Flip, crop after ``max(1, size // 8)`` padding, cutout of ``size // 2``."""
    from fedhet.algorithms.fedmatch import strong_augment

    assert repr(strong_augment(image_size)) == repr(
        fedmatch_module.Compose(
            [
                fedmatch_module.RandomHorizontalFlip(),
                fedmatch_module.RandomCropPad(padding),
                Cutout(cutout),
            ]
        )
    )
    assert type(strong_augment(image_size).augments[-1].size) is int


def test_fedmatch_strong_view_sizes_its_augmentation_by_the_image_width():
    """The view is ``strong_augment(width)`` seeded by one draw of the global stream (width 16 of an 8 x 16 batch)."""
    from fedhet.algorithms.fedmatch import strong_augment

    phase = FedMatch().build_collaborative_phase(public_clients(FedMatch()))
    x = torch.rand(2, 1, 8, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    view = phase.strong_view(x)
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, (1,)).item())
    assert torch.equal(view, strong_augment(16)(x, torch.Generator().manual_seed(seed)))


def test_fedmatch_threshold_one_is_refused_and_just_below_is_accepted():
    """A threshold of 1 would never pseudo-label: refused in one line."""
    FedMatch(threshold=0.99)
    with pytest.raises(ConfigError) as error:
        FedMatch(threshold=1.0)
    assert str(error.value) == "FedMatch: threshold=1.0 is not a number in [0, 1) (1 would never pseudo-label)"


def test_fedmatch_a_lone_client_has_no_helper_and_two_help_each_other():
    """One exchanging client: a zero loss that keeps the graph; two: each one's KL to the other (weight 2)."""
    phase = FedMatch(pseudo_label_weight=0.0, consistency_weight=2.0).build_collaborative_phase(
        public_clients(FedMatch())
    )
    x = torch.zeros(2, 1, 4, 4)
    z0 = torch.tensor([[2.0, 0.0], [0.0, 1.0]], requires_grad=True)
    z1 = torch.tensor([[0.0, 1.0], [3.0, 0.0]])
    phase.exchanging = [0]
    (alone,) = phase.distillation_losses([z0], x)
    assert alone.item() == 0.0 and alone.requires_grad
    phase.exchanging = [0, 1]
    first, second = phase.distillation_losses([z0, z1], x)
    assert first.item() == pytest.approx(2.0 * _kl(F.softmax(z1, 1), z0).item(), abs=1e-6)
    assert second.item() == pytest.approx(2.0 * _kl(F.softmax(z0.detach(), 1), z1).item(), abs=1e-6)
