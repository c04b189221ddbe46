"""CCVR (server pooling, virtual features, head-only calibration) and FedType (conformal reciprocal distillation)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms.ccvr import CALIBRATE, CCVRClient, CCVRServer, GaussianStatsPayload
from fedhet.algorithms.fedtype import FedTypeClient, FedTypeHparams, per_sample_kl, reciprocal_weights
from fedhet.core.payloads import ClassStatsPayload
from fedhet.core.state import clone_state
from fedhet.errors import TrainingError
from tests.algorithms.helpers import TinyLinear, fit, one_batch_loader, tiny_loop, upload


def _stats(means, covariances, counts) -> GaussianStatsPayload:
    return GaussianStatsPayload(
        means=torch.tensor(means), covariances=torch.tensor(covariances), counts=torch.tensor(counts), num_examples=3
    )


def _server() -> CCVRServer:
    from tests.algorithms.helpers import head_context

    server = CCVRServer()
    server.setup_server(head_context(num_classes=2, feature_dim=1))
    return server


def test_ccvr_traffic_counts_only_the_classes_sent():
    """Only held classes are counted: 2 of 3 classes x (2 + 4 floats x 4 B + one int64 count) = 64 B at p = 2.

    The server's download counts the classes it has statistics for (here class 0 only).
    """
    payload = GaussianStatsPayload(
        means=torch.zeros(3, 2), covariances=torch.zeros(3, 2, 2), counts=torch.tensor([3, 0, 1])
    )
    assert payload.nbytes() == 2 * (2 * 4 + 4 * 4 + 8)
    server = _server()
    server.aggregate(0, [upload(0, _stats([[1.0], [0.0]], [[[2.0]], [[0.0]]], [2, 0]))])
    download = server.download_for(0)
    assert download is not None and download.nbytes() == 1 * (4 + 4 + 8)


def test_ccvr_server_pools_each_class_over_uploaders_and_keeps_absent_ones():
    """Class 0: A {0, 2} and B {4} pool to mean 2, variance 4; class 1 only in A (mean 7, var 1)."""
    server = _server()
    server.aggregate(
        0,
        [
            upload(0, _stats([[1.0], [7.0]], [[[2.0]], [[1.0]]], [2, 2])),
            upload(1, _stats([[4.0], [0.0]], [[[0.0]], [[0.0]]], [1, 0])),
        ],
    )
    pooled = server.download_for(0)
    torch.testing.assert_close(pooled.means, torch.tensor([[2.0], [7.0]]))
    torch.testing.assert_close(pooled.covariances, torch.tensor([[[4.0]], [[1.0]]]))
    assert pooled.counts.tolist() == [3, 2]
    server.aggregate(1, [upload(1, _stats([[5.0], [0.0]], [[[0.0]], [[0.0]]], [1, 0]))])
    torch.testing.assert_close(server.download_for(1).means, torch.tensor([[5.0], [7.0]]))  # class 1 kept
    with pytest.raises(TrainingError, match="counts"):
        server.check_upload(upload(0, _stats([[1.0], [1.0]], [[[0.0]], [[0.0]]], [-1, 1])))


def test_ccvr_virtual_features_follow_the_global_gaussians():
    """4,000 draws per class match the downloaded mean and covariance; classes without statistics get none."""
    client = CCVRClient(TinyLinear(), 2, virtual_per_class=4000, jitter=0.0)
    client.on_receive(
        _stats([[1.0, -1.0], [5.0, 5.0]], [[[1.0, 0.5], [0.5, 2.0]], [[1.0, 0.0], [0.0, 1.0]]], [3, 0])
    )
    features, labels = client.virtual_features(seed=0)
    assert labels.unique().tolist() == [0]  # a class without statistics gets no virtual feature
    torch.testing.assert_close(features.mean(0), torch.tensor([1.0, -1.0]), atol=0.08, rtol=0)
    torch.testing.assert_close(torch.cov(features.T), torch.tensor([[1.0, 0.5], [0.5, 2.0]]), atol=0.12, rtol=0)


def test_ccvr_calibration_moves_the_head_only():
    """The calibrate stage trains the head on virtual features and leaves the extractor untouched."""
    client = CCVRClient(TinyLinear(), 2, virtual_per_class=8)
    client.on_receive(_stats([[1.0, 0.0], [0.0, 1.0]], [[[0.1, 0.0], [0.0, 0.1]]] * 2, [3, 3]))
    assert [s.name for s in client.local_stages()] == ["local", CALIBRATE]
    before = clone_state(client.state_dict())
    client.stage = CALIBRATE
    loader = client.stage_dataloader(None, seed=0)
    fit(client, loader)
    after = client.state_dict()
    assert torch.equal(before["model.body.weight"], after["model.body.weight"])
    assert not torch.equal(before["model.head.weight"], after["model.head.weight"])


def test_fedtype_reciprocal_weights_follow_the_smaller_prediction_set():
    """The proxy teaches only where its set is strictly smaller; otherwise the private model teaches."""
    proxy_teaches, private_teaches = reciprocal_weights(torch.tensor([1, 3, 2]), torch.tensor([2, 1, 2]), 3)
    assert proxy_teaches.tolist() == [0.0, 1.0, 0.0] and private_teaches.tolist() == [1.0, 0.0, 1.0]


def test_fedtype_empty_prediction_set_is_the_least_certain():
    """An empty set (no class above the threshold) loses to any non-empty set and ties with a full one.

    Private sizes (0, 1, 0, 0, 4), proxy sizes (1, 0, 0, 4, 0), C = 4: read as (4, 1, 4, 4, 4) and
    (1, 4, 4, 4, 4), the proxy is strictly more certain only on the first sample.
    """
    proxy_teaches, private_teaches = reciprocal_weights(
        torch.tensor([0, 1, 0, 0, 4]), torch.tensor([1, 0, 0, 4, 0]), num_classes=4
    )
    assert proxy_teaches.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert private_teaches.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_fedtype_loss_lets_the_nonempty_set_teach():
    """An empty private set loses to the proxy's set {0}: the proxy teaches.

    Identity private model with threshold 0.2 (p = (0.731, 0.269): no 1 - p_y <= 0.2, the set is
    empty); proxy 2 x identity with threshold 0.5 (set {0}): loss = CEs + KL(p_proxy || p_private).
    """
    private, proxy = TinyLinear(), TinyLinear(head=2.0 * torch.eye(2))
    client = FedTypeClient(private, 2, proxy, kd_weight=1.0)
    client.private_threshold, client.proxy_threshold = torch.tensor(0.2), torch.tensor(0.5)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    p = F.softmax(torch.tensor([[1.0, 0.0]]), 1)[0]
    q = F.softmax(torch.tensor([[2.0, 0.0]]), 1)[0]
    expected = -p[0].log() - q[0].log() + (q * (q.log() - p.log())).sum()
    assert client.local_loss((x, y)).item() == pytest.approx(expected.item(), abs=1e-6)


def test_fedtype_loss_by_hand():
    """Identity private model; proxy = 2 x identity. Thresholds 0.5 (private) and 0.9 (proxy).

    Sample x = (1, 0), y = 0: private p = softmax(1, 0) = (0.731, 0.269), set {0} (size 1);
    proxy p = softmax(2, 0) = (0.881, 0.119), set {0, 1} (1 - 0.119 = 0.881 <= 0.9, size 2):
    the private model is more certain, so it teaches the proxy: loss = CE_priv + CE_proxy + KL(p_priv || p_proxy).
    """
    private, proxy = TinyLinear(), TinyLinear(head=2.0 * torch.eye(2))
    client = FedTypeClient(private, 2, proxy, kd_weight=1.0)
    client.private_threshold, client.proxy_threshold = torch.tensor(0.5), torch.tensor(0.9)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    loss = client.local_loss((x, y))
    private_logits, proxy_logits = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]])
    p, q = F.softmax(private_logits, 1), F.softmax(proxy_logits, 1)
    expected = (
        F.cross_entropy(private_logits, y) + F.cross_entropy(proxy_logits, y) + (p * (p.log() - q.log())).sum()
    )
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert per_sample_kl(proxy_logits, private_logits).item() == pytest.approx((p * (p.log() - q.log())).sum().item())


def test_fedtype_calibrates_thresholds_on_its_training_data():
    """The private threshold is the hand-computed conformal quantile of its scores."""
    client = FedTypeClient(TinyLinear(), 2, TinyLinear(head=2.0 * torch.eye(2)), conformal_alpha=0.5)
    x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1, 1])
    client.calibrate([(x, y)])
    # private scores 1 - p_y: 0.269, 0.269, 0.731 -> rank ceil(4 * 0.5) = 2 -> 0.269
    assert client.private_threshold.item() == pytest.approx(1 - torch.sigmoid(torch.tensor(1.0)).item(), abs=1e-6)
    fit(client, one_batch_loader(x, y))  # on_train_start recalibrates from the fit's loader
    assert 0.0 < client.proxy_threshold.item() <= 1.0


def test_ccvr_sampling_factor_survives_a_slightly_indefinite_covariance():
    """A rank-deficient covariance nudged below zero still gets a factor reproducing it within the jitter."""
    from fedhet.algorithms.ccvr import sampling_factor

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    covariance = a @ a.T
    covariance[0, 0] -= 1e-3
    factor = sampling_factor(covariance, 1e-4)
    assert (factor @ factor.T - covariance).abs().max().item() < 2e-3
    eye = torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(sampling_factor(eye, 0.0), eye)


def test_ccvr_sampling_factor_adds_the_jitter_in_the_covariance_precision():
    """A positive-definite covariance is factored by Cholesky of ``Sigma + jitter I`` in its own dtype (float64)."""
    from fedhet.algorithms.ccvr import sampling_factor

    covariance = torch.tensor([[2.0, 0.3], [0.3, 1.0]], dtype=torch.float64)
    expected = torch.linalg.cholesky(covariance + 1e-4 * torch.eye(2, dtype=torch.float64))
    assert torch.equal(sampling_factor(covariance, 1e-4), expected)  # a float32 jitter differs in the last bits


def test_ccvr_client_calibrates_only_while_it_holds_the_servers_gaussians():
    """No calibration before a download or after an empty one; a class counted once is sampled like any other."""
    client = CCVRClient(TinyLinear(), 2, virtual_per_class=3)
    assert [s.name for s in client.local_stages()] == ["local"]
    client.on_receive(_stats([[1.0, 0.0], [0.0, 1.0]], [[[0.0, 0.0], [0.0, 0.0]]] * 2, [0, 1]))
    assert [s.name for s in client.local_stages()] == ["local", CALIBRATE]
    features, labels = client.virtual_features(seed=0)
    assert labels.tolist() == [1, 1, 1] and features.shape == (3, 2)
    client.on_receive(None)
    assert [s.name for s in client.local_stages()] == ["local"]
    client.on_receive(ClassStatsPayload(values=torch.zeros(2, 2), counts=torch.tensor([1, 1])))
    assert [s.name for s in client.local_stages()] == ["local"]  # not Gaussians: nothing to calibrate on


def test_ccvr_calibration_batches_are_shuffled_by_the_stage_seed_alone():
    """Batches of ``calibration_batch_size`` in an order drawn from the stage's seed: same seed, same batches."""
    client = CCVRClient(TinyLinear(), 2, virtual_per_class=20, calibration_batch_size=8)
    client.on_receive(_stats([[1.0, 0.0], [0.0, 1.0]], [[[0.1, 0.0], [0.0, 0.1]]] * 2, [3, 3]))
    client.stage = CALIBRATE

    def labels(seed):
        batches = list(client.stage_dataloader(None, seed=seed))
        assert [len(y) for _, y in batches] == [8, 8, 8, 8, 8]
        return torch.cat([y for _, y in batches])

    torch.manual_seed(1)
    first = labels(3)
    torch.manual_seed(2)  # the global stream plays no part
    assert torch.equal(labels(3), first)
    assert not torch.equal(first, first.sort().values)  # shuffled, not class after class
    assert not torch.equal(labels(4), first)
    client.stage = "local"
    private = [(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))]
    assert client.stage_dataloader(private, seed=3) is private


def test_ccvr_server_skips_a_class_nobody_sent_and_pools_the_next():
    """Class 0 absent from every upload keeps its zeros; class 1 after it is still pooled."""
    server = _server()
    server.aggregate(0, [upload(0, _stats([[0.0], [3.0]], [[[0.0]], [[2.0]]], [0, 4]))])
    pooled = server.download_for(0)
    assert pooled.counts.tolist() == [0, 4]
    torch.testing.assert_close(pooled.means, torch.tensor([[0.0], [3.0]]))
    torch.testing.assert_close(pooled.covariances, torch.tensor([[[0.0]], [[2.0]]]))


def test_ccvr_server_state_resumes_the_pooled_gaussians():
    """Nothing to save before the first uploads; afterwards a fresh server restores the same download."""
    server = _server()
    assert server.server_state() == {} and server.download_for(0) is None
    fresh = _server()
    fresh.load_server_state(server.server_state())
    assert fresh.download_for(0) is None
    server.aggregate(0, [upload(0, _stats([[1.0], [7.0]], [[[2.0]], [[1.0]]], [2, 2]))])
    state = server.server_state()
    assert sorted(state) == ["counts", "covariances", "means"]
    fresh.load_server_state(state)
    restored, original = fresh.download_for(1), server.download_for(1)
    for name in ("means", "covariances", "counts"):
        assert torch.equal(getattr(restored, name), getattr(original, name)), name


def test_ccvr_server_needs_a_linear_head_on_client_zero():
    """The feature width is read from client 0's head; a model without one is refused by name."""
    from tests.algorithms.helpers import assert_sized_by_client_zeros_head

    assert_sized_by_client_zeros_head(CCVRServer, "CCVR needs client models with a linear 'head' (FeatureClassifier)")


def test_ccvr_server_refuses_uploads_by_name():
    """Each refusal names the client and the field; counts are checked against what the client holds."""
    from tests.algorithms.helpers import context, head_context

    initial = head_context(num_classes=2, feature_dim=1).initial_client_state(0)
    server = CCVRServer()
    server.setup_server(context(num_classes=2, initial=initial, label_counts=torch.tensor([[2, 2], [1, 0]])))
    good = _stats([[1.0], [7.0]], [[[2.0]], [[1.0]]], [2, 2])
    server.check_upload(upload(0, good))

    def refusal(client_id, payload):
        with pytest.raises(TrainingError) as error:
            server.check_upload(upload(client_id, payload))
        return str(error.value)

    wrong = ClassStatsPayload(values=torch.zeros(2, 1), counts=torch.tensor([1, 1]))
    assert refusal(0, wrong) == "client 0 sent ClassStatsPayload, expected class Gaussians (GaussianStatsPayload)"
    assert refusal(1, good) == (
        "client 1 sent class counts inconsistent with its data (class 0: 2 examples, it holds 1)"
    )
    assert refusal(0, dataclasses.replace(good, means=torch.zeros(2, 2))).startswith(
        "client 0 sent 'means' of shape (2, 2), expected (2, 1)"
    )
    assert refusal(0, dataclasses.replace(good, covariances=torch.zeros(2, 1, 1, dtype=torch.float64))).startswith(
        "client 0 sent 'covariances' as torch.float64 where the server holds torch.float32"
    )
    assert refusal(0, dataclasses.replace(good, counts=torch.tensor([1, 1, 1]))).startswith(
        "client 0 sent 'counts' of shape (3,), expected (2,)"
    )
    assert refusal(0, dataclasses.replace(good, means=torch.tensor([[float("nan")], [0.0]]))).startswith(
        "client 0 sent non-finite values in 'means'"
    )


def test_fedtype_thresholds_before_calibration_put_every_class_in_both_sets():
    """Uncalibrated thresholds are 1: both prediction sets are full, equal sizes, so the private model teaches."""
    private, proxy = TinyLinear(), TinyLinear(head=2.0 * torch.eye(2))
    client = FedTypeClient(private, 2, proxy, kd_weight=1.0)
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    private_logits, proxy_logits = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]])
    p, q = F.softmax(private_logits, 1), F.softmax(proxy_logits, 1)
    expected = F.cross_entropy(private_logits, y) + F.cross_entropy(proxy_logits, y) + (p * (p.log() - q.log())).sum()
    assert client.local_loss((x, y)).item() == pytest.approx(expected.item(), abs=1e-6)


def test_fedtype_proxies_start_from_one_shared_initialisation():
    """Every client's proxy is the shared model of shared_init_seed, whatever its private architecture."""
    from fedhet.algorithms.shared.common import build_shared_model

    def proxies(shared_init_seed: int) -> list[dict[str, torch.Tensor]]:
        loop = tiny_loop("fedtype", method_args={"shared_init_seed": shared_init_seed})
        return [
            loop.runtime.build_module(architecture, seed).proxy.state_dict()
            for seed, architecture in enumerate(dict.fromkeys(loop.architectures))
        ]

    first, second = proxies(3)
    scenario = tiny_loop("fedtype").scenario
    proxy_model = FedTypeHparams().proxy_model
    expected = build_shared_model(proxy_model, scenario.num_classes, scenario.in_channels, 3, "fedtype-proxy")
    expected = expected.state_dict()
    for key, value in expected.items():
        assert torch.equal(first[key], value) and torch.equal(second[key], value), key
    other = proxies(4)[0]
    assert any(not torch.equal(other[key], value) for key, value in expected.items())


@pytest.mark.parametrize(("weighting", "expected"), [("samples", 2.5), ("uniform", 2.0)])
def test_fedtype_server_averages_every_clients_proxy_into_one(weighting, expected):
    """One proxy average over all clients, whatever their private architectures, weighted as proxy_weighting says."""
    from fedhet.algorithms.base import ClientUpload
    from fedhet.algorithms.fedtype import FedType
    from fedhet.core.payloads import WeightsPayload
    from tests.algorithms.helpers import context

    server = FedType(proxy_weighting=weighting).build_server()
    initial = {"model.w": torch.zeros(1), "proxy.w": torch.zeros(1)}
    server.setup_server(context(num_classes=2, architectures=("a", "b"), initial=initial))
    assert server.download_for(1).weights["w"].item() == 0.0  # the shared initial proxy, sent before any average
    server.aggregate(0, [
        ClientUpload(0, "a", WeightsPayload(weights={"w": torch.tensor([1.0])}, num_examples=1)),
        ClientUpload(1, "b", WeightsPayload(weights={"w": torch.tensor([3.0])}, num_examples=3)),
    ])  # fmt: skip
    assert server.download_for(0).weights["w"].item() == server.download_for(1).weights["w"].item() == expected
