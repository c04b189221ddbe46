"""FedKTL: hand-computed payload sizes, shared initialisations, server training, ablation switches.

Unit tests use a tiny in-test generator with the ``fedhet.generators.GeneratorAdapter``
interface, so they need no artifact and pin down exactly what the server receives.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from fedhet.algorithms import fedktl
from fedhet.algorithms.base import ClientUpload, DataFormat, ServerContext
from fedhet.algorithms.fedktl import (
    FedKTL,
    FedKTLClient,
    FedKTLServer,
    GeneratedPairsPayload,
    shared_linear_init,
    to_client_images,
)
from fedhet.core.payloads import ClassStatsPayload
from fedhet.errors import TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.trainer import ServerTrainerTemplate, TrainerTemplate
from fedhet.functional import simplex_etf
from fedhet.models import create_model
from fedhet.seeding import seeded
from tests.algorithms.helpers import TinyLinear
from tests.conftest import tiny_label_skew


class TinyGenerator(nn.Module):
    """The GeneratorAdapter interface in a few lines: W is a shifted Gaussian, images a tanh of a linear map."""

    latent_dim = 6
    resolution = 8
    out_channels = 3

    def __init__(self) -> None:
        super().__init__()
        with seeded(11):
            self.to_image = nn.Linear(self.latent_dim, self.out_channels * self.resolution**2)
        for parameter in self.parameters():
            parameter.requires_grad_(False)

    def sample_w(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return 0.5 * torch.randn(n, self.latent_dim, generator=generator) + 3.0

    def synthesize(self, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.to_image(w)).view(-1, self.out_channels, self.resolution, self.resolution)


@pytest.fixture
def tiny_generator(monkeypatch):
    """Make FedKTL load the in-test TinyGenerator instead of a pretrained artifact."""
    generator = TinyGenerator()
    monkeypatch.setattr(fedktl, "_load_generator", lambda name: generator)
    return generator


def _client(architecture="cnn_tiny", num_classes=4, seed=0, **kwargs):
    model = create_model(architecture, num_classes=num_classes, in_channels=3, seed=seed, feature_dim=16)
    etf = simplex_etf(num_classes, num_classes, torch.Generator().manual_seed(0))
    return FedKTLClient(model, num_classes, etf=etf, latent_dim=6, latent_head_seed=123, **kwargs)


def _context(num_classes=4):
    """A two-client server context with ``num_classes`` classes (FedKTL's server reads nothing else)."""
    return ServerContext(
        num_clients=2,
        num_classes=num_classes,
        architectures=("a", "b"),
        seed=0,
        initial_client_state=lambda c: {},
        data_format=DataFormat(16, 3, (0.5,) * 3, (0.25,) * 3, num_classes),
    )


def _upload(client_id, values, counts):
    return ClientUpload(client_id, "a", ClassStatsPayload(values=values, counts=torch.tensor(counts)))


# ------------------------------------------------------------------ client


def test_latent_head_identical_across_architectures_and_reset_every_fit():
    """h'_i starts from one shared initialisation on every client, is reset each fit and never stored."""
    first, second = _client("cnn_tiny", seed=1), _client("mlp_tiny", seed=2)
    weight, bias = shared_linear_init(16, 6, 123)
    # nn.Linear's default bounds: 1/sqrt(fan_in) = 1/sqrt(16) = 0.25
    assert weight.abs().max() <= 0.25 and bias.abs().max() <= 0.25
    for client in (first, second):
        assert torch.equal(client.latent_head.weight, weight) and torch.equal(client.latent_head.bias, bias)
    with torch.no_grad():
        first.latent_head.weight.add_(1.0)
    first.reset_latent_head()
    assert torch.equal(first.latent_head.weight, weight)
    # never persisted: not in the client state, and loading a state leaves it alone
    state = first.client_state()
    assert not any(k.startswith("latent_head.") for k in state) and "etf" not in state
    second.load_client_state(_client("mlp_tiny", seed=5).client_state())
    assert torch.equal(second.latent_head.weight, weight)


def test_upload_is_unit_prototypes_of_held_classes_and_counts_their_bytes():
    """The upload holds unit prototypes of the held classes only, |C_i| (K floats + one count) bytes."""
    client = _client().eval()
    x = torch.randn(6, 3, 16, 16)
    y = torch.tensor([0, 0, 2, 2, 2, 0])
    with torch.no_grad():
        upload = client.make_upload([(x[:4], y[:4]), (x[4:], y[4:])])
    assert upload.counts.tolist() == [3, 0, 3, 0]
    norms = upload.values.norm(dim=1)
    assert torch.allclose(norms[[0, 2]], torch.ones(2), atol=1e-6) and torch.equal(norms[[1, 3]], torch.zeros(2))
    # |C_i| * K floats + one int64 count per class held: 2 * (4 * 4 + 8) = 48 bytes
    assert upload.nbytes() == 48


def test_prediction_is_cosine_to_fixed_etf_and_etf_is_not_trained():
    """Predictions are cosines to the fixed ETF, which is no parameter and identical for every client."""
    client = _client()
    assert not any(p is client.etf for p in client.parameters())
    x = torch.randn(5, 3, 16, 16)
    scores = client(x)
    assert scores.shape == (5, 4) and (scores.abs() <= 1.0 + 1e-6).all()
    # identical ETF on every client: both rebuilt from the same shared seed
    assert torch.equal(FedKTL().etf(4), FedKTL().etf(4))


def test_pairs_stream_gives_full_batches_and_covers_every_pair():
    """The pair stream always returns full batches and covers every downloaded pair in each pass."""
    client = _client()
    images, latents = torch.randn(3, 3, 16, 16), torch.arange(18.0).view(3, 6)
    client.on_receive(GeneratedPairsPayload(images=images, latents=latents))
    with seeded(0):
        drawn = [client.next_pairs(2)[1] for _ in range(3)]
    assert all(len(batch) == 2 for batch in drawn)
    # the first pass (3 pairs) is the first batch plus one pair of the second
    first_pass = torch.cat(drawn)[:3, 0].sort().values
    assert first_pass.tolist() == [0.0, 6.0, 12.0]
    client.on_receive(None)
    assert client.pair_latents is None


def test_pairs_stream_is_a_sequence_of_whole_passes():
    """Five pairs drawn two at a time: every run of five consecutive pairs is one pass, each pair once."""
    client = _client()
    client.on_receive(GeneratedPairsPayload(images=torch.randn(5, 3, 16, 16), latents=torch.arange(30.0).view(5, 6)))
    with seeded(0):
        drawn = torch.cat([client.next_pairs(2)[1][:, 0] for _ in range(5)])
    assert drawn[:5].sort().values.tolist() == drawn[5:].sort().values.tolist() == [0.0, 6.0, 12.0, 18.0, 24.0]


def test_client_rejects_pairs_of_wrong_latent_size():
    """Pairs whose latents do not match h'_i's output size are refused."""
    client = _client()
    with pytest.raises(TrainingError, match="latents"):
        client.on_receive(GeneratedPairsPayload(images=torch.zeros(2, 3, 16, 16), latents=torch.zeros(2, 5)))


# ------------------------------------------------------------------ server


def _fit(server):
    """Fit the server as the loop does: the server template with the stage's own budget (E_S passes, once)."""
    loader = server.server_dataloader(1)
    budget = server.refine_budget()
    ServerTrainerTemplate(accelerator="cpu").build(budget.epochs, budget.steps).fit(server, train_dataloaders=loader)


def _fitted_server(generator, epochs=2, **kwargs):
    server = FedKTLServer(generator, server_epochs=epochs, server_batch_size=100, **kwargs)
    server.setup_server(_context())
    torch.manual_seed(0)
    server.aggregate(
        0,
        [
            _upload(0, torch.nn.functional.normalize(torch.randn(4, 4), dim=1), [3, 2, 0, 0]),
            _upload(1, torch.nn.functional.normalize(torch.randn(4, 4), dim=1), [0, 5, 1, 7]),
        ],
    )
    with seeded(1):
        _fit(server)
    return server


def test_download_is_one_pair_per_class_with_paper_byte_count():
    """The download is one (image, latent) pair per class, C (ch*h*w + H) floats, after E_S server steps."""
    server = _fitted_server(TinyGenerator())
    download = server.download_for(0)
    assert download.images.shape == (4, 3, 16, 16) and download.latents.shape == (4, 6)
    # C * (ch*h*w + H) floats * 4 bytes = 4 * (3*16*16 + 6) * 4 = 4 * 774 * 4 = 12384
    assert download.nbytes() == 12384
    # 5 prototypes (2 + 3 held classes), 2 epochs of one batch each, and exactly one Lightning epoch
    assert server.metrics()["prototypes"] == 5.0 and server._steps == 2


def test_classes_never_uploaded_get_no_pair():
    """Classes no client has uploaded get no generated pair."""
    server = FedKTLServer(TinyGenerator(), server_epochs=1)
    server.setup_server(_context())
    server.aggregate(0, [_upload(0, torch.eye(4), [1, 1, 0, 0])])
    with seeded(1):
        _fit(server)
    assert server.download_for(0).latents.shape == (2, 6)


def test_final_centroids_are_class_means_of_transformed_prototypes():
    """The latents sent are the class means of F over this round's prototypes (eval mode)."""
    server = _fitted_server(TinyGenerator())
    server.transformer.eval()
    with torch.no_grad():
        mapped = server.transformer(server.prototypes)
    labels = server.prototype_labels
    expected = torch.stack([mapped[labels == c].mean(0) for c in range(4)])
    assert torch.allclose(server.download_for(0).latents, expected, atol=1e-6)


@pytest.mark.parametrize("centroid_mode", ["learned_table", "exact_mean"])
def test_server_training_lowers_its_loss(centroid_mode):
    """Sixty server epochs halve the server loss in both centroid modes."""
    generator = TinyGenerator()
    server = FedKTLServer(generator, server_epochs=1, centroid_mode=centroid_mode)
    server.setup_server(_context())
    torch.manual_seed(0)
    server.aggregate(0, [_upload(0, torch.nn.functional.normalize(torch.randn(4, 4), dim=1), [3, 2, 4, 1])] * 3)
    everything = torch.arange(len(server.prototypes))
    with seeded(5), torch.no_grad():
        before = server.server_losses(everything)["loss"].item()
    server.hp = dataclasses.replace(server.hp, server_epochs=60)
    with seeded(1):
        _fit(server)
    server.train()
    with seeded(5), torch.no_grad():
        after = server.server_losses(everything)["loss"].item()
    assert after < 0.5 * before


def test_server_rejects_malformed_prototypes():
    """Prototypes of the wrong size or with NaN are refused."""
    server = FedKTLServer(TinyGenerator())
    server.setup_server(_context())
    with pytest.raises(TrainingError, match="shape"):
        server.check_upload(_upload(0, torch.zeros(4, 5), [1, 1, 1, 1]))
    with pytest.raises(TrainingError, match="non-finite"):
        server.check_upload(_upload(0, torch.full((4, 4), float("nan")), [1, 1, 1, 1]))


def test_server_state_round_trips_without_the_generator():
    """The server state leaves out the frozen generator and restores the pairs and centroids exactly."""
    server = _fitted_server(TinyGenerator())
    state = server.server_state()
    assert not any(k.startswith("generator.") for k in state) and "pair_latents" in state
    restored = FedKTLServer(TinyGenerator())
    restored.setup_server(_context())
    restored.load_server_state(state)
    assert torch.equal(restored.download_for(0).images, server.download_for(0).images)
    assert torch.equal(restored.centroids.weight, server.centroids.weight)


def test_server_state_before_any_pairs_round_trips_and_shows_no_images():
    """A server checkpointed before its first pairs (round 0) restores without them and has no images to show."""
    server = FedKTLServer(TinyGenerator())
    server.setup_server(_context())
    assert server.images() == {} and server.download_for(0) is None
    assert server.metrics() == {"prototypes": 0.0}  # no losses, no spreads before anything was generated
    state = server.server_state()
    assert "pair_images" not in state and "pair_latents" not in state
    restored = FedKTLServer(TinyGenerator())
    restored.setup_server(_context())
    restored.load_server_state(state)
    assert restored.pair_images is None and restored.pair_latents is None and restored.images() == {}


def test_the_etf_follows_shared_seed():
    """Every party builds the same ETF from shared_seed; another shared_seed gives another ETF."""
    assert torch.equal(FedKTL(shared_seed=3).etf(4), FedKTL(shared_seed=3).etf(4))
    assert not torch.allclose(FedKTL(shared_seed=3).etf(4), FedKTL(shared_seed=4).etf(4))


def test_to_client_images_hand_values():
    """Generated images are mapped to [0, 1], resized, converted to the client's channels and normalised."""
    generated = torch.tensor([1.0, 1.0, -1.0]).view(1, 3, 1, 1).expand(1, 3, 2, 2)
    # [-1, 1] -> [0, 1]: (1, 1, 0); grey = mean = 2/3; normalised (2/3 - 0.5) / 0.25 = 2/3
    grey = to_client_images(generated, image_size=2, channels=1, mean=(0.5,), std=(0.25,))
    assert grey.shape == (1, 1, 2, 2) and torch.allclose(grey, torch.full((1, 1, 2, 2), 2.0 / 3.0))
    # 3 channels at 4x4: a constant image stays constant when resized; (1 - 0.5)/0.25 = 2, (0 - 0.5)/0.25 = -2
    rgb = to_client_images(generated, image_size=4, channels=3, mean=(0.5,) * 3, std=(0.25,) * 3)
    assert rgb.shape == (1, 3, 4, 4)
    assert torch.allclose(rgb[0, :, 0, 0], torch.tensor([2.0, 2.0, -2.0]))


def test_to_client_images_clamps_resizes_antialiased_and_converts_grey():
    """Outside [-1, 1] is clamped, resizing is antialiased bilinear, grey becomes RGB, 2 channels are refused.

    A 2x downscale is a triangle filter of support 2 with pixel centres not aligned; non-square images
    are resized too.
    """
    clamped = to_client_images(torch.tensor([1.5, -1.5, 1.5, -1.5]).view(1, 1, 2, 2), 2, 1, (0.5,), (0.25,))
    assert clamped[0, 0, 0].tolist() == [2.0, -2.0]  # 1.25 -> 1, -0.25 -> 0; then (v - 0.5) / 0.25
    # each row a ramp 0, 1/3, 2/3, 1 after the [0, 1] map; output pixel 0 is centred on input 0.5, so its
    # weights on pixels 0, 1, 2 are 1 - |d| / 2 = 3/4, 3/4, 1/4: (0 + 3/4 * 1/3 + 1/4 * 2/3) / (7/4) = 5/21,
    # and output pixel 1 (centre 2.5) on pixels 1, 2, 3: (1/4 * 1/3 + 3/4 * 2/3 + 3/4) / (7/4) = 16/21
    ramp = (2 * torch.arange(4.0) / 3 - 1).view(1, 1, 1, 4).expand(1, 1, 4, 4)
    small = to_client_images(ramp, 2, 1, (0.0,), (1.0,))
    assert torch.allclose(small[0, 0], torch.tensor([[5 / 21, 16 / 21]] * 2), atol=1e-6)
    assert to_client_images(torch.zeros(1, 1, 4, 8), 4, 1, (0.0,), (1.0,)).shape == (1, 1, 4, 4)
    assert to_client_images(torch.zeros(1, 1, 8, 4), 4, 1, (0.0,), (1.0,)).shape == (1, 1, 4, 4)
    # grey 0 -> 0.5 in every channel, normalised per channel: (0.5 - 0.5) / 0.25, (0.5 - 0.25) / 0.25, 0.5 / 0.5
    rgb = to_client_images(torch.zeros(2, 1, 3, 3), 3, 3, (0.5, 0.25, 0.0), (0.25, 0.25, 0.5))
    assert rgb.shape == (2, 3, 3, 3) and torch.equal(rgb[:, :, 1, 2], torch.tensor([[0.0, 1.0, 1.0]] * 2))
    with pytest.raises(TrainingError, match="^cannot convert 2-channel generated images to 3 channels$"):
        to_client_images(torch.zeros(1, 2, 3, 3), 3, 3, (0.5,) * 3, (0.25,) * 3)


# ------------------------------------------------------------------ whole runs (ablation switches)


def _run(algorithm, rounds=2):
    scenario = tiny_label_skew()
    loop = FederationLoop(
        algorithm, scenario, ["cnn_tiny", "mlp_tiny", "cnn_tiny"], TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds, feature_dim=16,
    )
    return loop, loop.run()


def test_mu_zero_is_exactly_the_no_transfer_ablation_and_mu_positive_is_not(tiny_generator, monkeypatch):
    """With mu = 0 FedKTL equals the -L^M ablation bit for bit, mu > 0 differs, and h'_i starts identical."""
    _, without_mu = _run(FedKTL(mu=0.0, server_epochs=2))
    _, without_task = _run(FedKTL(use_latent_task=False, server_epochs=2))
    latent_heads_at_fit_start = []
    original = FedKTLClient.on_train_start

    def record(self):
        original(self)
        latent_heads_at_fit_start.append(self.latent_head.weight.detach().clone())

    monkeypatch.setattr(FedKTLClient, "on_train_start", record)
    loop, full = _run(FedKTL(server_epochs=2))
    # h'_i starts identical for every client (two architectures) in every round: 3 clients x 2 rounds
    assert len(latent_heads_at_fit_start) == 6
    assert all(torch.equal(w, latent_heads_at_fit_start[0]) for w in latent_heads_at_fit_start)
    assert without_mu["final"] == without_task["final"]
    assert full["final"] != without_task["final"]  # round 1 trains on the generated pairs
    # download per client and round = C * (ch*h*w + H) * 4 = 10 * (3*16*16 + 6) * 4 = 30960 bytes, 3 clients in round 1
    assert full["comm"]["bytes_down"] == 3 * 30960
    assert loop.history[-1]["server/centroid_spread"] > 0


def test_without_etf_uses_the_original_classifier_and_feature_prototypes(tiny_generator):
    """The -ETF ablation keeps the classifier and uploads K'-dimensional feature prototypes."""
    loop, summary = _run(FedKTL(use_etf=False, server_epochs=2), rounds=1)
    assert loop.server.transformer[0].in_features == 16  # K' = feature_dim
    assert 0.0 <= summary["final"]["acc_local"] <= 100.0


# ------------------------------------------------------------------ hand-computed losses


def test_client_loss_is_arcface_plus_mu_latent_regression_by_hand():
    """ArcFace on cosines to the ETF (s = 2, m = 0.5) plus mu * MSE(h'(f(image)), latent) on the downloaded pair."""
    etf = torch.tensor([[1.0, -1.0], [0.0, 0.0]])  # K = 2, C = 2: class vectors e1 and -e1
    client = FedKTLClient(TinyLinear(), 2, etf=etf, latent_dim=2, latent_head_seed=0, scale=2.0, margin=0.5, mu=0.5)
    with torch.no_grad():  # h_i (the projection in the head's place) and h'_i set to identities
        for layer in (client.model.head, client.latent_head):
            layer.weight.copy_(torch.eye(2))
            layer.bias.zero_()
    x, y = torch.tensor([[1.0, 1.0]]), torch.tensor([0])
    # projection [1, 1]: cosines (1/sqrt 2, -1/sqrt 2); target logit s cos(pi/4 + m), other s * (-1/sqrt 2)
    target, other = 2.0 * math.cos(math.pi / 4 + 0.5), -2.0 / math.sqrt(2.0)
    arcface = math.log1p(math.exp(other - target))
    assert client.local_loss((x, y)).item() == pytest.approx(arcface, rel=1e-6)
    assert torch.allclose(client(x), torch.tensor([[1 / math.sqrt(2), -1 / math.sqrt(2)]]), atol=1e-6)
    # one pair: image features [2, 0] (an image of shape [2, 1, 1]), latent [1, 1]: MSE = (1 + 1) / 2
    client.on_receive(GeneratedPairsPayload(images=torch.tensor([2.0, 0.0]).view(1, 2, 1, 1), latents=torch.ones(1, 2)))
    assert client.local_loss((x, y)).item() == pytest.approx(arcface + 0.5 * 1.0, rel=1e-6)


class FixedLatents(TinyGenerator):
    """A two-dimensional latent space whose samples are always (0, 0), (1, 1), ..."""

    latent_dim = 2

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.to_image = nn.Linear(self.latent_dim, self.out_channels * self.resolution**2).requires_grad_(False)

    def sample_w(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32).unsqueeze(1).expand(n, self.latent_dim).clone()


def test_server_loss_is_mmd_plus_centroid_mse_by_hand():
    """MMD^2 (one RBF bandwidth) of F(P) against the generator's latents plus lambda = 0.5 times the centroid MSE."""
    server = FedKTLServer(
        FixedLatents(), etf_dim=2, centroid_weight=0.5, server_epochs=1, server_batch_size=2, mmd_bandwidths=(1.0,)
    )
    server.setup_server(_context(num_classes=2))
    with torch.no_grad():  # F = Linear(I) -> BatchNorm (fresh) -> ReLU -> Linear(I)
        for layer in (server.transformer[0], server.transformer[3]):
            layer.weight.copy_(torch.eye(2))
            layer.bias.zero_()
    server.aggregate(0, [_upload(0, torch.eye(2), [3, 1])])
    # centroids start as the eval-mode class means: BatchNorm's running statistics (0, 1) leave P / sqrt(1 + eps)
    assert torch.allclose(server.centroids.weight, torch.eye(2), atol=1e-5)
    with torch.no_grad():
        server.centroids.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    losses = server.server_losses(torch.tensor([0, 1]))
    # train-mode BatchNorm over the two prototypes: (P - 0.5) / sqrt(0.25 + eps) -> ReLU -> d I, d = 0.99998
    d = 0.5 / math.sqrt(0.25 + 1e-5)
    mapped, latents = [(d, 0.0), (0.0, d)], [(0.0, 0.0), (1.0, 1.0)]

    def kernel(a, b):
        return math.exp(-((a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2) / 2.0)

    def mean_kernel(first, second):
        return sum(kernel(a, b) for a in first for b in second) / (len(first) * len(second))

    mmd = mean_kernel(mapped, mapped) + mean_kernel(latents, latents) - 2 * mean_kernel(mapped, latents)
    mse = (d**2 + 1.0 + 1.0 + d**2) / 4  # mapped d I against centroids [[0, 1], [1, 0]]
    assert losses["mmd"].item() == pytest.approx(mmd, rel=1e-5)
    assert losses["mse"].item() == pytest.approx(mse, rel=1e-5)
    assert losses["loss"].item() == pytest.approx(mmd + 0.5 * mse, rel=1e-5)


# ------------------------------------------------------------------ class-image diagnostics (Fig. 5)


def _pairwise_rms_by_hand(images):
    """Mean RMS distance over ordered pairs of different images, in a double loop."""
    flat = images.flatten(1).double()
    distances = [((flat[i] - flat[j]) ** 2).mean().sqrt() for i in range(len(flat)) for j in range(len(flat)) if i != j]
    return float(sum(distances) / len(distances))


def _spread_by_hand(generator):
    """The unit: 64 random latents of a fixed private RNG, in the clients' image format (size 16, mean/std .5/.25)."""
    w = generator.sample_w(64, torch.Generator().manual_seed(0))
    return _pairwise_rms_by_hand(to_client_images(generator.synthesize(w), 16, 3, (0.5,) * 3, (0.25,) * 3))


def test_image_separation_and_change_are_in_units_of_the_generator_spread():
    """Separation = mean pairwise RMS of the class images / spread; change = mean RMS change of the classes in both.

    Round 0 holds classes 0 and 1, round 1 all four: the change compares classes 0 and 1 only, and
    drawing the unit leaves the run's RNG untouched.
    """
    generator = TinyGenerator()
    server = FedKTLServer(generator, server_epochs=1)
    server.setup_server(_context())
    server.aggregate(0, [_upload(0, torch.eye(4), [1, 1, 0, 0])])
    with seeded(1):
        _fit(server)
    spread = _spread_by_hand(generator)
    first = server.download_for(0).images.clone()
    state = torch.random.get_rng_state()
    metrics = server.metrics()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert server.image_spread == pytest.approx(spread, rel=1e-9)
    assert metrics["image_separation"] == pytest.approx(_pairwise_rms_by_hand(first) / spread, rel=1e-9)
    assert "image_change" not in metrics  # nothing to compare with in the first round
    torch.manual_seed(0)
    server.aggregate(1, [_upload(0, torch.nn.functional.normalize(torch.randn(4, 4), dim=1), [1, 2, 3, 4])])
    with seeded(2):
        _fit(server)
    second = server.download_for(0).images
    assert second.shape[0] == 4
    change = [float(((second[c] - first[c]).double() ** 2).mean().sqrt()) for c in (0, 1)]
    metrics = server.metrics()
    assert metrics["image_change"] == pytest.approx(sum(change) / 2 / spread, rel=1e-9)
    assert metrics["image_separation"] == pytest.approx(_pairwise_rms_by_hand(second) / spread, rel=1e-9)
    assert set(server.images()) == {"class_images"} and torch.equal(server.images()["class_images"], second)


# ------------------------------------------------------------------ what a first mutation pass found untested


def test_shared_linear_init_is_nn_linears_uniform_bound():
    """Weight and bias are U(-1/sqrt(fan_in), 1/sqrt(fan_in)) from the seed alone (nn.Linear's default rule)."""
    weight, bias = shared_linear_init(16, 400, seed=5)
    again, _ = shared_linear_init(16, 400, seed=5)
    bound = 1 / 16**0.5  # 0.25
    assert torch.equal(weight, again) and weight.shape == (400, 16) and bias.shape == (400,)
    for values in (weight, bias):
        assert float(values.abs().max()) <= bound
        assert float(values.max()) > 0.9 * bound and float(values.min()) < -0.9 * bound


def test_mean_prototypes_are_plain_class_means_of_the_projection():
    """prototype_mode 'mean' (the paper's Eq.): the class means of h_i(f_i(x)), and the counts of each class."""
    client = _client(prototype_mode="mean")
    client.eval()
    torch.manual_seed(0)
    x, y = torch.randn(5, 3, 16, 16), torch.tensor([0, 2, 0, 2, 3])
    with torch.no_grad():
        _, projected = client.embed(x)
        upload = client.make_upload([(x[:3], y[:3]), (x[3:], y[3:])])
    expected = torch.zeros(4, 4)
    for c in (0, 2, 3):
        expected[c] = projected[y == c].mean(0)
    assert torch.allclose(upload.values[[0, 2, 3]], expected[[0, 2, 3]], atol=1e-6)
    assert upload.counts.tolist() == [2, 0, 2, 1]
    with pytest.raises(TrainingError, match="^a FedKTL client without training data cannot upload prototypes$"):
        client.make_upload([])


def test_projection_head_has_the_etf_dimension():
    """h_i maps features to K = etf_dim (not the class count) when the ETF is K x C with K != C."""
    model = create_model("cnn_tiny", num_classes=4, in_channels=3, seed=0, feature_dim=16)
    etf = simplex_etf(4, 6, torch.Generator().manual_seed(0))
    client = FedKTLClient(model, 4, etf=etf, latent_dim=6, latent_head_seed=1)
    assert client.model.head.out_features == 6 and client.etf.shape == (6, 4)
    assert "etf" not in client.state_dict()  # rebuilt from the shared seed, never stored
    with pytest.raises(ValueError, match=r"^ETF of shape \(6, 4\) for 3 classes$"):
        FedKTLClient(create_model("cnn_tiny", num_classes=3, in_channels=3, seed=0, feature_dim=16), 3, etf=etf,
                     latent_dim=6, latent_head_seed=1)


def test_classification_loss_uses_the_configured_margin():
    """The ArcFace margin is the client's, not arcface_logits' default."""
    from fedhet.functional import arcface_logits, etf_cosines

    client = _client(margin=0.2, scale=8.0)
    projected, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    expected = torch.nn.functional.cross_entropy(arcface_logits(etf_cosines(projected, client.etf), y, 8.0, 0.2), y)
    assert torch.allclose(client.classification_loss(projected, y), expected)


def test_a_fresh_fit_clears_the_latent_heads_optimizer_state():
    """on_train_start drops h'_i's optimizer state (a fresh h'_i) and keeps the model's."""
    client = _client()
    optimizer = torch.optim.Adam(list(client.model.parameters()) + list(client.latent_head.parameters()))
    for parameter in optimizer.param_groups[0]["params"]:
        optimizer.state[parameter] = {"step": torch.tensor(3.0)}
    client._trainer = type("T", (), {"optimizers": [optimizer]})()
    client.on_train_start()
    kept = set(optimizer.state)
    assert not any(p in kept for p in client.latent_head.parameters())
    assert all(p in kept for p in client.model.parameters())


def test_server_rejects_prototypes_of_classes_not_held_or_of_another_dtype():
    """Counts above what the client holds, or float64 values, are refused naming the client."""
    server = FedKTLServer(TinyGenerator())
    server.setup_server(dataclasses.replace(_context(), label_counts=torch.tensor([[3, 2, 0, 0], [0, 5, 1, 7]])))
    good = torch.nn.functional.normalize(torch.randn(4, 4), dim=1)
    server.check_upload(_upload(0, good, [3, 2, 0, 0]))
    with pytest.raises(TrainingError, match="client 0"):
        server.check_upload(_upload(0, good, [3, 2, 1, 0]))  # class 2: client 0 holds none
    with pytest.raises(TrainingError, match="client 1.*float64|float64.*client 1"):
        server.check_upload(_upload(1, good.double(), [0, 5, 1, 7]))
    wrong_payload = r"^client 0 sent GeneratedPairsPayload, expected ClassStatsPayload prototypes$"
    with pytest.raises(TrainingError, match=wrong_payload):
        server.check_upload(ClientUpload(0, "a", GeneratedPairsPayload(images=torch.zeros(1, 3, 2, 2),
                                                                       latents=torch.zeros(1, 6))))


def test_server_batches_follow_the_seed_and_drop_single_prototypes():
    """E_S passes of index batches: the same seed the same order, size-1 tails dropped; no image format, no data."""
    server = FedKTLServer(TinyGenerator(), server_epochs=2, server_batch_size=2)
    server.setup_server(_context())
    server.aggregate(0, [_upload(0, torch.nn.functional.normalize(torch.randn(4, 4), dim=1), [1, 1, 1, 0])])
    batches = [b.tolist() for b in server.server_dataloader(7)]
    assert len(batches) == 2 and all(len(b) == 2 for b in batches)  # 3 prototypes: [2, (1 dropped)] per pass
    assert batches == [b.tolist() for b in server.server_dataloader(7)]
    orders = {tuple(map(tuple, (b.tolist() for b in server.server_dataloader(seed)))) for seed in range(6)}
    assert len(orders) > 1
    bare = FedKTLServer(TinyGenerator())
    bare.setup_server(dataclasses.replace(_context(), data_format=None))
    with pytest.raises(TrainingError, match="^FedKTL's server needs the scenario's image format in its context$"):
        bare.server_dataloader(0)


def test_server_metrics_are_round_means_and_need_two_classes_for_spreads(monkeypatch):
    """Losses are the mean of what the steps computed; centroid and image spreads need two or more classes."""
    recorded: list[dict[str, float]] = []
    original = FedKTLServer.server_losses

    def recording(self, batch):
        """The real losses, kept as numbers."""
        losses = original(self, batch)
        recorded.append({key: float(value.detach()) for key, value in losses.items()})
        return losses

    monkeypatch.setattr(FedKTLServer, "server_losses", recording)
    server = _fitted_server(TinyGenerator())
    metrics = server.metrics()
    assert len(recorded) == server._steps == 2 and recorded[0]["loss"] != recorded[1]["loss"]
    for key in recorded[0]:
        assert metrics[key] == pytest.approx((recorded[0][key] + recorded[1][key]) / 2, rel=1e-6), key
    assert metrics["centroid_spread"] == pytest.approx(float(torch.pdist(server.pair_latents).mean()))

    def fitted_on_classes(counts):
        """A one-epoch server fitted on two uploads holding the classes ``counts`` marks."""
        server = FedKTLServer(TinyGenerator(), server_epochs=1)
        server.setup_server(_context())
        server.aggregate(0, [_upload(0, torch.eye(4), counts)] * 2)
        with seeded(1):
            _fit(server)
        return server

    two = fitted_on_classes([1, 1, 0, 0])
    assert len(two.pair_latents) == 2
    assert two.metrics()["centroid_spread"] == pytest.approx(float(torch.dist(*two.pair_latents)))
    single = fitted_on_classes([1, 0, 0, 0])
    assert len(single.pair_latents) == 1
    assert "centroid_spread" not in single.metrics() and "image_separation" not in single.metrics()


def test_the_first_round_has_no_image_change_to_report():
    """Before any earlier round's images exist, the change is None, even for classes seen now."""
    server = _fitted_server(TinyGenerator())
    assert bool(server.seen.any()) and server.class_image_change(None, server.seen) is None


@pytest.mark.parametrize("clip", [1e-3, None])
def test_server_clips_f_and_the_centroid_table_separately(clip):
    """``grad_clip_norm`` caps the gradient norm of F and of the centroid table each; ``None`` leaves both."""
    server = FedKTLServer(TinyGenerator(), grad_clip_norm=clip)
    server.setup_server(_context())
    groups = [list(server.transformer.parameters()), list(server.centroids.parameters())]
    for group in groups:
        for parameter in group:
            parameter.grad = torch.ones_like(parameter)
    server.on_before_optimizer_step(None)
    for group in groups:
        norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in group])))
        expected = clip if clip is not None else math.sqrt(sum(p.numel() for p in group))
        assert norm == pytest.approx(expected, rel=1e-4)


def test_the_server_expects_prototypes_in_the_etf_dimension():
    """With ``etf_dim`` K != C the server's F maps K-d prototypes and refuses C-d ones."""
    server = FedKTLServer(TinyGenerator(), etf_dim=6)
    server.setup_server(_context(num_classes=4))
    assert server.prototype_dim == 6 and server.transformer[0].in_features == 6
    server.check_upload(_upload(0, torch.nn.functional.normalize(torch.randn(4, 6), dim=1), [1, 1, 0, 0]))
    with pytest.raises(TrainingError, match="shape"):
        server.check_upload(_upload(0, torch.eye(4), [1, 1, 0, 0]))


def test_the_generator_is_loaded_by_its_declared_name(monkeypatch):
    """``_load_generator`` asks the generators package for the name it was given (other tests replace it whole)."""
    import fedhet.generators as generators

    names: list[str] = []
    monkeypatch.setattr(generators, "load_generator", lambda name: names.append(name) or TinyGenerator())
    assert isinstance(fedktl._load_generator("embedded_stylegan"), TinyGenerator)
    assert names == ["embedded_stylegan"]


def test_the_server_initialisation_follows_the_run_seed():
    """F and the centroid table start from the run's seed: the same seed, the same start; another, another."""

    def start(seed):
        server = FedKTLServer(TinyGenerator())
        server.setup_server(dataclasses.replace(_context(), seed=seed))
        return torch.cat([p.detach().flatten() for p in server.parameters() if p.requires_grad])

    assert torch.equal(start(0), start(0)) and not torch.equal(start(0), start(1))


def test_a_too_small_server_batch_is_refused_naming_the_setting():
    """B_S < 2 cannot train F's BatchNorm; the error names the setting and why."""
    from fedhet.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^FedKTL: server_batch_size=1 must be >= 2 \(BatchNorm in F\)$"):
        FedKTL(server_batch_size=1)


def test_pairs_payload_checks_its_shapes_naming_the_sender():
    """Images must be [n>0, ch, h, w] and latents [n, H]; the error names who sent them."""
    good = GeneratedPairsPayload(images=torch.zeros(2, 3, 4, 4), latents=torch.zeros(2, 6))
    good.validate_pairs(6)
    with pytest.raises(TrainingError, match=r"^server sent generated images of shape \(3, 4, 4\), expected"):
        GeneratedPairsPayload(images=torch.zeros(3, 4, 4), latents=torch.zeros(3, 6)).validate_pairs(6)
    with pytest.raises(TrainingError, match=r"^relay sent generated images of shape \(0, 3, 4, 4\)"):
        GeneratedPairsPayload(images=torch.zeros(0, 3, 4, 4), latents=torch.zeros(0, 6)).validate_pairs(6, "relay")
    with pytest.raises(TrainingError, match=r"^server sent 'latents' of shape \(2, 6\), expected \(2, 5\); "):
        good.validate_pairs(5)
    with pytest.raises(TrainingError, match="server"):
        nan_images = torch.full((2, 3, 4, 4), float("nan"))
        GeneratedPairsPayload(images=nan_images, latents=torch.zeros(2, 6)).validate_pairs(6)


def test_the_declared_generator_is_loaded_once_and_the_untrained_one_warns(monkeypatch, caplog):
    """build_server and build_client share one generator, loaded by its declared name; 'untrained' warns."""
    import logging

    loaded = []
    monkeypatch.setattr(fedktl, "_load_generator", lambda name: loaded.append(name) or TinyGenerator())
    model = create_model("cnn_tiny", num_classes=4, in_channels=3, seed=0, feature_dim=16)
    with caplog.at_level(logging.WARNING, logger="fedhet"):
        method = FedKTL(generator="embedded-stylegan")
        method.build_server(), method.build_client(model, 4)
        assert loaded == ["embedded-stylegan"] and not caplog.records
        FedKTL(generator="untrained").build_server()
    assert loaded[-1] == "untrained"
    assert [r.getMessage() for r in caplog.records] == [
        "FedKTL uses the untrained generator: fine for tests, but it does not reproduce the paper"]


def test_the_latent_head_follows_shared_seed(tiny_generator):
    """h'_i's shared initialisation comes from shared_seed: another seed, another h'_i."""
    model = create_model("cnn_tiny", num_classes=4, in_channels=3, seed=0, feature_dim=16)
    heads = [FedKTL(shared_seed=s).build_client(model, 4).latent_head.weight for s in (1, 1, 2)]
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
