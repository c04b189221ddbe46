"""Hand-computed checks of FedKTL's geometry: simplex ETF, ArcFace logits, unit prototypes, MMD^2."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedhet.functional import arcface_logits, etf_cosines, rbf_mmd2, simplex_etf, unit_class_prototypes

# pairwise cosine of a simplex ETF: -1/(C-1), written out per C
SIMPLEX_COSINE = {3: -0.5, 4: -1.0 / 3.0, 10: -1.0 / 9.0}


@pytest.mark.parametrize("num_classes", [3, 4, 10])
@pytest.mark.parametrize("extra_dims", [-1, 0, 5])  # K = C - 1, K = C, K > C
def test_simplex_etf_unit_columns_and_equal_angles(num_classes, extra_dims):
    """A simplex ETF has unit columns with pairwise cosine -1/(C-1), also for K = C - 1."""
    dim = num_classes + extra_dims
    etf = simplex_etf(num_classes, dim, torch.Generator().manual_seed(7))
    assert etf.shape == (dim, num_classes)
    gram = (etf.T @ etf).double()
    expected = torch.full((num_classes, num_classes), SIMPLEX_COSINE[num_classes], dtype=torch.float64)
    expected.fill_diagonal_(1.0)
    assert torch.allclose(gram, expected, atol=1e-5)
    # the class vectors of a simplex sum to zero
    assert torch.allclose(etf.sum(dim=1), torch.zeros(dim), atol=1e-5)


def test_simplex_etf_same_generator_seed_same_frame_and_bad_dims_refused():
    """The same generator seed gives the same frame; too few dimensions are refused."""
    first = simplex_etf(4, 6, torch.Generator().manual_seed(3))
    second = simplex_etf(4, 6, torch.Generator().manual_seed(3))
    other = simplex_etf(4, 6, torch.Generator().manual_seed(4))
    assert torch.equal(first, second) and not torch.allclose(first, other)
    with pytest.raises(ValueError, match="dim >= 3"):
        simplex_etf(4, 2)
    with pytest.raises(ValueError, match="at least 2"):
        simplex_etf(1, 4)


def test_etf_cosines_ignore_scale():
    """ETF cosines normalise both the embeddings and the ETF columns."""
    etf = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # columns (1, 0) and (0, 2)
    embeddings = torch.tensor([[3.0, 4.0]])  # unit direction (0.6, 0.8)
    assert torch.allclose(etf_cosines(embeddings, etf), torch.tensor([[0.6, 0.8]]))


def test_arcface_logits_two_class_hand_example():
    """ArcFace adds the margin to the target angle only, scaled by s, by hand."""
    cosines = torch.tensor([[0.6, -0.6], [0.0, 1.0]])
    labels = torch.tensor([0, 1])
    logits = arcface_logits(cosines, labels, scale=2.0, margin=0.5)
    # row 0: theta_y = acos(0.6) = 0.9272952; cos(0.9272952 + 0.5) = cos(1.4272952) = 0.1430091
    #        (= 0.6 cos 0.5 - 0.8 sin 0.5 = 0.5265495 - 0.3835404); the other class keeps 2 * -0.6
    # row 1: theta_y = 0; cos(0.5) = 0.8775826; the other class keeps 2 * 0.0
    expected = torch.tensor([[2.0 * 0.1430091, -1.2], [0.0, 2.0 * 0.8775826]])
    assert torch.allclose(logits, expected, atol=1e-5)


def test_arcface_without_margin_and_scale_is_cross_entropy_over_cosines():
    """With s = 1 and m = 0 ArcFace is the plain cross-entropy over cosines."""
    cosines = torch.tensor([[0.2, -0.4, 0.9], [0.5, 0.1, -0.3]])
    labels = torch.tensor([2, 0])
    loss = F.cross_entropy(arcface_logits(cosines, labels, scale=1.0, margin=0.0), labels)
    # -log softmax by hand: row 0: log(e^.2 + e^-.4 + e^.9) - .9 ; row 1: log(e^.5 + e^.1 + e^-.3) - .5
    row0 = math.log(math.exp(0.2) + math.exp(-0.4) + math.exp(0.9)) - 0.9
    row1 = math.log(math.exp(0.5) + math.exp(0.1) + math.exp(-0.3)) - 0.5
    assert loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-6)


def test_arcface_gradient_finite_at_cosine_one():
    """The ArcFace gradient stays finite at cosine +-1."""
    cosines = torch.tensor([[1.0, -1.0]], requires_grad=True)
    F.cross_entropy(arcface_logits(cosines, torch.tensor([0])), torch.tensor([0])).backward()
    assert torch.isfinite(cosines.grad).all()


def test_unit_class_prototypes_hand_example():
    """Unit prototypes normalise, average per class and normalise again, by hand."""
    embeddings = torch.tensor([[3.0, 4.0], [0.0, 2.0], [1.0, 0.0]])
    labels = torch.tensor([0, 0, 1])
    prototypes, counts = unit_class_prototypes(embeddings, labels, 3)
    # class 0: normalised rows (0.6, 0.8) and (0, 1) -> mean (0.3, 0.9) -> / sqrt(0.9) = (0.3162278, 0.9486833)
    # class 1: (1, 0); class 2 absent: zero row, count 0
    expected = torch.tensor([[0.3162278, 0.9486833], [1.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(prototypes, expected, atol=1e-6)
    assert counts.tolist() == [2, 1, 0]


def test_mmd2_zero_for_identical_sets():
    """The MMD of a set to itself is zero."""
    x = torch.tensor([[0.0, 1.0], [2.0, -1.0], [4.0, 3.0]])
    assert rbf_mmd2(x, x.clone()).abs().item() < 1e-6


def test_mmd2_one_dimensional_two_point_sets_by_hand():
    """MMD^2 of two 2-point sets by hand, for one and for two bandwidths."""
    x = torch.tensor([[0.0], [1.0]])
    y = torch.tensor([[0.0], [2.0]])
    # bandwidth a = 0.5: k = exp(-d^2). mean Kxx = (1 + e^-1)/2, mean Kyy = (1 + e^-4)/2,
    # mean Kxy = (1 + e^-4 + 2 e^-1)/4 (pairs at distance^2 0, 4, 1, 1) -> MMD^2 = (1 - e^-1)/2 = 0.3160603
    assert rbf_mmd2(x, y, bandwidths=(0.5,)).item() == pytest.approx(0.3160603, abs=1e-6)
    # adding a = 1.0 (k = exp(-d^2 / 2)) adds (1 - e^-0.5)/2 = 0.1967347 -> 0.5127950
    assert rbf_mmd2(x, y, bandwidths=(0.5, 1.0)).item() == pytest.approx(0.5127950, abs=1e-6)


def test_mmd2_gradient_step_lowers_it():
    """The MMD gradient pulls a set towards the other and a step lowers it."""
    x = torch.tensor([[0.0], [1.0]], requires_grad=True)
    y = torch.tensor([[3.0], [4.0]])
    before = rbf_mmd2(x, y, bandwidths=(1.0, 4.0))
    before.backward()
    # the set as a whole is pulled towards y (the within-x repulsion spreads it, so test the mean)
    assert x.grad.sum() < 0
    with torch.no_grad():
        after = rbf_mmd2(x - 0.5 * x.grad, y, bandwidths=(1.0, 4.0))
    assert after < before


@pytest.mark.parametrize("num_classes, dim", [(2, 2), (3, 3), (4, 3), (4, 7)])
def test_simplex_etf_is_the_official_construction(num_classes, dim):
    """The frame rebuilt here from the paper and the official code, bit for bit, for one generator seed.

    K >= C: sqrt(C/(C-1)) U (I - 11^T/C), U the Q of a uniform [K, C] draw; K = C - 1:
    sqrt(C/(C-1)) W B^T, W the Q of a uniform [K, C-1] draw, B an orthonormal basis of 1's complement.
    """
    c = num_classes
    generator = torch.Generator().manual_seed(11)
    centering = torch.eye(c, dtype=torch.float64) - 1.0 / c
    if dim >= c:
        frame = torch.linalg.qr(torch.rand(dim, c, generator=generator, dtype=torch.float64))[0] @ centering
    else:
        basis = torch.linalg.qr(centering[:, : c - 1])[0]
        frame = torch.linalg.qr(torch.rand(dim, c - 1, generator=generator, dtype=torch.float64))[0] @ basis.T
    expected = (math.sqrt(c / (c - 1)) * frame).float()
    assert torch.equal(simplex_etf(c, dim, torch.Generator().manual_seed(11)), expected)


def test_etf_cosines_normalise_the_columns_not_the_rows():
    """Columns (3, 4) and (0, 1) have norms 5 and 1 (rows 3 and sqrt 17): the cosine of e_1 with column 0 is 3/5."""
    etf = torch.tensor([[3.0, 0.0], [4.0, 1.0]])
    assert etf_cosines(torch.tensor([[1.0, 0.0]]), etf).tolist() == [[pytest.approx(0.6), 0.0]]


def test_arcface_defaults_and_mmd_refusal():
    """ArcFace's s = 64 and m = 0.5 when not given; an MMD without bandwidths is refused by name."""
    cosines, labels = torch.tensor([[0.3, -0.2], [0.1, 0.9]]), torch.tensor([0, 1])
    assert torch.equal(arcface_logits(cosines, labels), arcface_logits(cosines, labels, 64.0, 0.5))
    with pytest.raises(ValueError, match=r"^rbf_mmd2 needs at least one bandwidth$"):
        rbf_mmd2(torch.zeros(2, 1), torch.zeros(2, 1), ())
