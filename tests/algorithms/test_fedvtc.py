"""FedVTC: the VTC, the client's losses, the server's averages, the synthetic set, traffic and resume."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms.base import DataFormat, LocalStage, ServerContext
from fedhet.algorithms.fedvtc import (
    FINETUNE,
    STEP_A,
    STEP_B,
    VTC_SYNC,
    EpochAlternation,
    FedVTC,
    FedVTCClient,
    FedVTCServer,
    LatentPrior,
    VTCDecoder,
    VTCPayload,
    decode_latents,
    initial_prototypes,
    linear_feature_projection,
)
from fedhet.core.payloads import Payload
from fedhet.core.state import clone_state
from fedhet.data.tensors import TensorBatchLoader, TensorData
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation.trainer import TrainerTemplate
from fedhet.functional.vtc import gaussian_kl_to_prior
from fedhet.models import create_model
from fedhet.seeding import derive_seed
from tests.algorithms.helpers import (
    FAST,
    TinyLinear,
    differing,
    fit,
    one_batch_loader,
    saved_and_loaded,
    state_digests,
    tiny_loop,
    upload,
)


@pytest.mark.parametrize(
    "latent, channels, out, image, params",
    [
        ((20, 7, 7), (16, 32, 32), 1, (1, 28, 28), 21_043),
        ((64, 8, 8), (32, 64, 64), 3, (3, 32, 32), 91_625),
        ((128, 16, 16), (64, 64, 64), 3, (3, 64, 64), 179_785),
    ],
)
def test_vtc_decoder_shapes_and_sizes_of_table_6(latent, channels, out, image, params):
    """MNIST 20x7x7 -> 1x28x28, CIFAR 64x8x8 -> 3x32x32, Tiny 128x16x16 -> 3x64x64; outputs in (0, 1)."""
    decoder = VTCDecoder(latent, channels, out)
    assert sum(p.numel() for p in decoder.parameters()) == params
    with torch.no_grad():
        images = decoder(torch.randn(4, latent[0] * latent[1] * latent[2]))
    assert tuple(images.shape) == (4, *image)
    assert float(images.min()) > 0.0 and float(images.max()) < 1.0


def test_vtc_decoder_layers_of_table_6():
    """Transposed conv, BatchNorm, LeakyReLU(0.01) three times, then transposed conv, BatchNorm, Sigmoid."""
    decoder = VTCDecoder((20, 7, 7), (16, 32, 32), 1)
    kinds = [type(layer).__name__ for layer in decoder.net]
    assert kinds == ["ConvTranspose2d", "BatchNorm2d", "LeakyReLU"] * 3 + ["ConvTranspose2d", "BatchNorm2d", "Sigmoid"]
    assert [layer.negative_slope for layer in decoder.net if isinstance(layer, nn.LeakyReLU)] == [0.01] * 3
    assert decoder.out_channels == 1 and decoder.latent_shape == (20, 7, 7)


class _LinearDecoder(nn.Module):
    """A hand-computable 'VTC': image = sigmoid-free identity reshaped to ``[1, 1, 2]``."""

    latent_shape = (1, 1, 2)
    out_channels = 1

    def forward(self, v):
        return v.reshape(v.shape[0], 1, 1, 2)


def _client(dm_weight: float = 0.0) -> FedVTCClient:
    return FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), dm_weight=dm_weight)  # type: ignore[arg-type]


def test_vtc_loss_is_rc_plus_kl_plus_dm_by_hand():
    """One sample of class 0, x = (1, 0), identity g: z = (1, 0), prototypes c^0 = (0, 1), sigma = 1.

    With noise eps the latent is v = z + eps, the 'image' is v: L_rc = ||eps||^2, KL = 0.5 * ||z - c||^2
    = 1 (the sigma terms vanish at sigma = 1), L_dm = ||g(v) - c||^2 = ||v - c||^2.
    """
    client = _client(dm_weight=0.5)
    client.latent.prototypes.copy_(torch.tensor([[0.0, 1.0], [5.0, 5.0]]))
    x, y = torch.tensor([[1.0, 0.0]]).reshape(1, 1, 1, 2), torch.tensor([0])
    torch.manual_seed(3)
    eps = torch.randn(1, 2)
    torch.manual_seed(3)
    loss = client.vtc_loss(x, y, client.model.forward_features(x))
    v = torch.tensor([[1.0, 0.0]]) + eps
    expected = eps.pow(2).sum() + 1.0 + 0.5 * (v - torch.tensor([[0.0, 1.0]])).pow(2).sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    dm = (v - torch.tensor([[0.0, 1.0]])).pow(2).sum().item()
    assert client.last_terms == pytest.approx({"rc": eps.pow(2).sum().item(), "kl": 1.0, "dm": dm}, abs=1e-5)


@pytest.mark.parametrize("dm_weight, reduction", [(1.0, "class_mean_sum"), (1.0, "batch_mean"), (0.0, "batch_mean")])
def test_the_logged_terms_follow_the_loss_reduction(dm_weight, reduction):
    """last_terms holds each term reduced as the loss is (class-mean sum or batch mean); L_dm only when weighted."""
    client = FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), dm_weight=dm_weight, reduction=reduction)  # type: ignore[arg-type]
    client.latent.log_sigma.data.fill_(-30.0)  # sigma ~ 0: v = z, L_rc = 0, L_dm = ||z - c||^2 = 2 KL / sigma-free
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]).reshape(3, 1, 1, 2)
    y = torch.tensor([0, 0, 1])
    client.vtc_loss(x, y, client.model.forward_features(x))
    squared = torch.tensor([1.0, 9.0, 4.0])  # ||z - 0||^2 per sample (zero prototypes)
    per_class = (squared[0] + squared[1]) / 2 + squared[2]
    expected_dm = float(per_class if reduction == "class_mean_sum" else squared.mean())
    assert set(client.last_terms) == ({"rc", "kl", "dm"} if dm_weight else {"rc", "kl"})
    assert client.last_terms["rc"] == pytest.approx(0.0, abs=1e-6)
    if dm_weight:
        assert client.last_terms["dm"] == pytest.approx(expected_dm, rel=1e-5)


def test_pixels_travel_between_the_scenario_and_the_vtc():
    """Targets: de-normalised, a one-channel VTC's averaged over channels; generated images: replicated, normalised."""
    client = FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), pixel_mean=(0.5, 0.5, 0.5), pixel_std=(0.5, 0.25, 0.5))  # type: ignore[arg-type]
    x = torch.tensor([0.0, 2.0, -1.0]).view(1, 3, 1, 1).expand(1, 3, 1, 2)
    pixels = torch.tensor([0.5, 1.0, 0.0]).view(1, 3, 1, 1).expand(1, 3, 1, 2)
    torch.testing.assert_close(client.vtc_target(x), pixels.mean(1, keepdim=True))  # one-channel VTC: the mean
    client.vtc.out_channels = 3
    torch.testing.assert_close(client.vtc_target(x), pixels)
    grey = torch.full((1, 1, 1, 2), 0.75)
    expected = (torch.full((1, 3, 1, 2), 0.75) - 0.5) / torch.tensor([0.5, 0.25, 0.5]).view(1, 3, 1, 1)
    torch.testing.assert_close(client.model_input(grey), expected)
    colour = torch.rand(1, 3, 1, 2)
    std = torch.tensor([0.5, 0.25, 0.5]).view(1, 3, 1, 1)
    torch.testing.assert_close(client.model_input(colour), (colour - 0.5) / std)
    mono = FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), pixel_mean=(0.5,), pixel_std=(0.5,))  # type: ignore[arg-type]
    torch.testing.assert_close(mono.vtc_target(torch.ones(1, 1, 1, 2)), torch.ones(1, 1, 1, 2))
    torch.testing.assert_close(mono.model_input(grey), torch.full((1, 1, 1, 2), 0.5))


def test_vtc_loss_sums_class_means():
    """Two samples of class 0 and one of class 1: the loss is mean over class 0 plus the class-1 value."""
    client = _client()
    client.latent.log_sigma.data.fill_(-30.0)  # sigma ~ 0: v = z exactly, L_rc = 0
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]).reshape(3, 1, 1, 2)
    y = torch.tensor([0, 0, 1])
    kl = gaussian_kl_to_prior(x.flatten(1), client.latent.log_sigma, torch.zeros(3, 2))
    loss = client.vtc_loss(x, y, client.model.forward_features(x))
    assert loss.item() == pytest.approx(((kl[0] + kl[1]) / 2 + kl[2]).item(), rel=1e-5)


@pytest.mark.parametrize("round_idx, kl_in_loss", [(0, 0.0), (1, 0.0), (2, 3.0)])
def test_kl_warmup_gates_the_kl_term_in_the_first_rounds(round_idx, kl_in_loss):
    """kl_warmup_rounds=2, kl_weight=3: L_tc = L_rc in rounds 0 and 1, L_rc + 3 * KL from round 2.

    The setup of the hand-computed case above (z = (1, 0), c^0 = (0, 1), sigma = 1): KL = 1.
    """
    decoder = _LinearDecoder()
    client = FedVTCClient(TinyLinear(), 2, vtc=decoder, dm_weight=0.0, kl_weight=3.0, kl_warmup_rounds=2)  # type: ignore[arg-type]
    client.latent.prototypes.copy_(torch.tensor([[0.0, 1.0], [5.0, 5.0]]))
    client.round_idx = round_idx
    x, y = torch.tensor([[1.0, 0.0]]).reshape(1, 1, 1, 2), torch.tensor([0])
    torch.manual_seed(3)
    eps = torch.randn(1, 2)
    torch.manual_seed(3)
    loss = client.vtc_loss(x, y, client.model.forward_features(x))
    assert loss.item() == pytest.approx(eps.pow(2).sum().item() + kl_in_loss, abs=1e-5)
    assert client.last_terms["kl"] == pytest.approx(1.0)  # logged unweighted either way


def test_fine_tuning_clips_the_gradient_to_max_grad_norm():
    """In the fine-tuning stage the step's gradient norm is cut to max_grad_norm (0.5); local stages clip themselves."""
    client = FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), max_grad_norm=0.5)  # type: ignore[arg-type]
    x, y = torch.tensor([[30.0, -20.0]]).reshape(1, 1, 1, 2), torch.tensor([1])
    client.stage = FINETUNE
    client.local_loss((x, y)).backward()
    norm = lambda: torch.cat([p.grad.flatten() for p in client.model.parameters()]).norm().item()  # noqa: E731
    assert norm() > 5.0
    client.on_before_optimizer_step(None)
    assert norm() == pytest.approx(0.5, rel=1e-4)
    client.stage = "local"
    client.local_loss((x, y)).backward()
    before = norm()
    client.on_before_optimizer_step(None)  # the manual local stage clips in training_step, not here
    assert norm() == pytest.approx(before)


@pytest.mark.parametrize("finetune_lr, expected", [(None, 0.05), (0.005, 0.005)])
def test_fine_tuning_steps_at_finetune_lr_or_the_rounds_lr(finetune_lr, expected):
    """finetune_lr=None keeps Algorithm 1's single eta (lr 0.05); set, only the fine-tuning optimizer uses it."""
    client = FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), lr=0.05, finetune_lr=finetune_lr)  # type: ignore[arg-type]
    client.stage = FINETUNE
    assert client.configure_optimizers().param_groups[0]["lr"] == expected
    client.stage = "local"
    model_optimizer, vtc_optimizer = client.configure_optimizers()
    assert model_optimizer.param_groups[0]["lr"] == vtc_optimizer.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize(
    "phase, mode, stages",
    [
        ("federation", "epochs", [LocalStage("local", manual=True)]),
        (VTC_SYNC, "epochs", []),  # the VTC upload trains nothing
        (FINETUNE, "epochs", [LocalStage(FINETUNE, epochs=3)]),
        (FINETUNE, "literal_fullbatch", [LocalStage(FINETUNE, steps=1)]),  # one full-batch step per round
    ],
)
def test_local_stages_of_each_phase(phase, mode, stages):
    """Rounds: one manual stage (the alternating steps); fine-tuning: finetune_epochs epochs or one step."""
    client = FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), finetune_epochs=3, finetune_mode=mode)  # type: ignore[arg-type]
    client.phase = phase
    assert list(client.local_stages()) == stages


def test_received_prototypes_and_sigma_land_in_the_clients_precision():
    """A float64 client takes the log of a received float32 sigma in float64 and keeps its other classes."""
    client = FedVTCClient(TinyLinear(), 3, vtc=_LinearDecoder()).double()  # type: ignore[arg-type]
    sigma = torch.tensor([3.0, 0.7])
    client.on_receive(VTCPayload(classes=torch.tensor([2]), prototypes=torch.tensor([[1.5, -2.0]]), sigma=sigma))
    assert client.latent.log_sigma.dtype == client.latent.prototypes.dtype == torch.float64
    assert torch.equal(client.latent.log_sigma.detach(), sigma.double().log())
    assert not torch.equal(sigma.log().double(), sigma.double().log())  # the float32 log differs
    assert torch.equal(client.latent.prototypes, torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.5, -2.0]]).double())


def test_the_vtc_and_sigma_step_at_vtc_lr_when_set():
    """vtc_lr=None: Algorithm 1's single eta for both optimizers; set, it is the VTC's and sigma's rate only."""
    client = FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), lr=0.05, vtc_lr=0.3)  # type: ignore[arg-type]
    client.stage = "local"
    model_optimizer, vtc_optimizer = client.configure_optimizers()
    assert model_optimizer.param_groups[0]["lr"] == 0.05 and vtc_optimizer.param_groups[0]["lr"] == 0.3


def _finetune_client(**hp) -> FedVTCClient:
    client = FedVTCClient(TinyLinear(), 2, vtc=_LinearDecoder(), synthetic_per_class=4, finetune_batch_size=4, **hp)  # type: ignore[arg-type]
    client.stage = FINETUNE
    return client


def test_fine_tuning_batches_shuffle_by_the_step_seed_alone():
    """Mini-batches: a shuffle drawn from the step's seed (not the global RNG); the full batch: the set in order."""
    client = _finetune_client()
    labels = [[y.tolist() for _, y in client.stage_dataloader([], seed=seed)] for seed in (5, 5, 6)]
    torch.manual_seed(123)  # another global RNG state changes nothing
    again = [y.tolist() for _, y in client.stage_dataloader([], seed=5)]
    assert labels[0] == labels[1] == again and labels[0] != labels[2]
    assert sorted(sum(labels[0], [])) == [0] * 4 + [1] * 4 and sum(labels[0], []) != [0] * 4 + [1] * 4
    full = list(_finetune_client(finetune_mode="literal_fullbatch").stage_dataloader([], seed=5))
    assert len(full) == 1 and full[0][1].tolist() == [0] * 4 + [1] * 4


def test_the_synthetic_set_is_drawn_once_from_its_stored_seed():
    """The seed is drawn at the first fine-tuning step and kept; -1 means not drawn, so a stored 0 is a seed."""
    client = _finetune_client()
    client.stage_dataloader([], seed=5)
    drawn = int(client.latent.synthetic_seed)
    assert drawn == derive_seed(5, "fedvtc-synthetic")
    client.stage_dataloader([], seed=6)
    assert int(client.latent.synthetic_seed) == drawn
    client.latent.synthetic_seed.fill_(0)
    client.stage_dataloader([], seed=6)
    assert int(client.latent.synthetic_seed) == 0


def test_synthetic_batch_norm_uses_the_statistics_of_the_decoded_latents():
    """synthetic_bn="batch" normalises with the synthetic latents' own statistics, whatever the running ones say.

    Running statistics far off the latents (mean 5, variance 100) make the eval-mode decoder emit
    nearly one image for every latent, as the averaged VTC did; the batch statistics recover the
    train-mode output (unbiased vs biased variance: equal to 1e-3 at 400 latents) and leave the VTC unchanged.
    """
    torch.manual_seed(0)
    decoder = VTCDecoder((4, 2, 2), (3, 3, 3), 1)
    for module in decoder.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.fill_(5.0)
            module.running_var.fill_(100.0)
    saved = clone_state(decoder.state_dict())
    v = 0.1 * torch.randn(400, 16)
    running = decode_latents(decoder, v, "running")
    batch = decode_latents(decoder, v, "batch")
    assert all(torch.equal(saved[k], t) for k, t in decoder.state_dict().items())
    decoder.train()
    with torch.no_grad():
        train_mode = decoder(v)
    assert running.std(0).mean() < 0.01 < batch.std(0).mean()
    torch.testing.assert_close(batch, train_mode, atol=1e-3, rtol=0.0)


def test_alternating_step_updates_f_with_ce_plus_tc_and_psi_with_tc():
    """One batch moves f_k, psi_k and sigma_k; step A's backward reaches f_k only (psi_k, sigma_k frozen)."""
    algorithm = FedVTC(latent_channels=4, vtc_channels=(2, 2, 2), lr=0.1)
    algorithm.configure(DataFormat(image_size=8, channels=1, mean=(0.0,), std=(1.0,), num_classes=2))
    module = algorithm.build_client(create_model("cnn_tiny", num_classes=2, in_channels=1, seed=0), 2)
    with torch.no_grad():
        module.latent.log_sigma.fill_(-12.0)  # sigma ~ 6e-6: the latent is z, whatever noise is drawn
    before = clone_state(module.state_dict())
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])
    module.stage = "local"
    module.automatic_optimization = False
    meter = fit(module, one_batch_loader(x, y))
    after = module.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("model.") for k in changed)
    assert any(k.startswith("vtc.") for k in changed)
    assert "latent.log_sigma" in changed
    # the classifier step alone: CE + L_tc with psi and sigma frozen leaves them untouched
    module.load_state_dict(before)
    module.zero_grad(set_to_none=True)
    model_optimizer, vtc_optimizer = module.configure_optimizers()
    module._freeze(vtc=True)
    module.train()
    z = module.model.forward_features(x)
    loss = F.cross_entropy(module.model.forward_head(z), y) + module.vtc_loss(x, y, z)
    assert meter.steps == 1 and meter.mean() == pytest.approx(loss.item(), rel=1e-6)  # the runtime sees CE + L_tc
    loss.backward()
    assert all(p.grad is None for p in module.vtc.parameters()) and module.latent.log_sigma.grad is None
    assert all(p.grad is not None for p in module.model.parameters())
    assert len(model_optimizer.param_groups[0]["params"]) == len(list(module.model.parameters()))
    assert len(vtc_optimizer.param_groups[0]["params"]) == len(list(module.vtc.parameters())) + 1


def test_a_plain_trainer_with_a_logger_fits_the_client_and_logs_step_as_loss(tmp_path):
    """Reuse: manual optimisation under a plain Trainer; train/loss (step and epoch) is step A's CE + L_tc."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from fedhet.federation.trainer import silence_lightning

    silence_lightning()
    torch.manual_seed(0)
    algorithm = FedVTC(latent_channels=4, vtc_channels=(2, 2, 2), lr=0.1, dm_weight=0.1)
    algorithm.configure(DataFormat(image_size=8, channels=1, mean=(0.0,), std=(1.0,), num_classes=2))
    module = algorithm.build_client(create_model("cnn_tiny", num_classes=2, in_channels=1, seed=0), 2)
    module.stage = "local"  # as built: manual optimisation is the client's own setting
    with torch.no_grad():
        module.latent.log_sigma.fill_(-12.0)  # sigma ~ 6e-6: the loss does not depend on the noise drawn
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])
    before = clone_state(module.state_dict())
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=CSVLogger(tmp_path), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(module, one_batch_loader(x, y))
    logged = {key: float(value) for key, value in trainer.logged_metrics.items()}
    module.load_state_dict(before)
    module.train()
    module._freeze(vtc=True)
    z = module.model.forward_features(x)
    loss = (F.cross_entropy(module.model.forward_head(z), y) + module.vtc_loss(x, y, z)).item()
    assert logged == pytest.approx({"train/loss_step": loss, "train/loss_epoch": loss}, rel=1e-5)
    assert set(trainer.progress_bar_metrics) == {"train/loss_step", "train/loss_epoch"}


def test_dm_kept_out_of_the_extractor_step_trains_only_the_vtc():
    """``dm_trains_extractor=False``: f_k steps exactly as with lambda = 0 (L_e), psi_k still steps on L_dm."""

    def one_batch(**kwargs):
        algorithm = FedVTC(latent_channels=4, vtc_channels=(2, 2, 2), lr=0.1, **kwargs)
        algorithm.configure(DataFormat(image_size=8, channels=1, mean=(0.0,), std=(1.0,), num_classes=2))
        module = algorithm.build_client(create_model("cnn_tiny", num_classes=2, in_channels=1, seed=0), 2)
        module.stage = "local"
        module.automatic_optimization = False
        torch.manual_seed(0)
        fit(module, one_batch_loader(torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])))
        return dict(module.named_parameters())

    paper = one_batch(dm_weight=0.1)
    vtc_only = one_batch(dm_weight=0.1, dm_trains_extractor=False)
    without_dm = one_batch(dm_weight=0.0)
    for name, value in vtc_only.items():
        if name.startswith("model."):
            torch.testing.assert_close(value, without_dm[name], rtol=0, atol=0)
    assert any(not torch.equal(paper[n], vtc_only[n]) for n in paper if n.startswith("model."))
    assert any(not torch.equal(vtc_only[n], without_dm[n]) for n in vtc_only if n.startswith("vtc."))


def _local_client(alternate: str = "batch") -> FedVTCClient:
    """A FedVTC client in its local stage, its p-neck seeded too (the global RNG draws it)."""
    torch.manual_seed(0)
    algorithm = FedVTC(latent_channels=4, vtc_channels=(2, 2, 2), lr=0.1, dm_weight=0.1, alternate=alternate)
    algorithm.configure(DataFormat(image_size=8, channels=1, mean=(0.0,), std=(1.0,), num_classes=2))
    module = algorithm.build_client(create_model("cnn_tiny", num_classes=2, in_channels=1, seed=0), 2)
    module.stage = "local"
    module.automatic_optimization = False
    return module


def test_epoch_alternation_replays_one_pass_for_step_a_then_step_b():
    """Every local epoch: the pass's mini-batches marked A, then the very same ones (same permutation) marked B."""
    data = TensorData(torch.randint(0, 256, (10, 1, 8, 8), dtype=torch.uint8), torch.arange(10))
    loader = TensorBatchLoader(data, batch_size=4, shuffle=True, seed=3, mean=(0.0,), std=(1.0,))
    alternation = EpochAlternation(loader)
    assert len(alternation) == 2 * len(loader) == 6
    for _ in range(2):  # two epochs: each draws a new permutation and replays it
        batches = list(alternation)
        assert [int(step) for _, _, step in batches] == [STEP_A] * 3 + [STEP_B] * 3
        for (xa, ya, _), (xb, yb, _) in zip(batches[:3], batches[3:], strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert sorted(torch.cat([y for _, y, _ in batches[:3]]).tolist()) == list(range(10))


class _MarkedBatch:
    """A loader of one mini-batch marked for step A or step B, as :class:`EpochAlternation` yields them."""

    def __init__(self, x, y, step):
        self.batch = (x, y, torch.tensor(step))

    def __len__(self):
        return 1

    def __iter__(self):
        yield self.batch


def test_epoch_alternation_steps_only_the_marked_half():
    """A batch marked A moves f_k alone (psi_k and sigma_k frozen), one marked B moves psi_k and sigma_k alone."""
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])
    for step, moved, still in ((STEP_A, "model.", ("vtc.", "latent.")), (STEP_B, "vtc.", ("model.",))):
        module = _local_client("epoch")
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        torch.manual_seed(0)
        meter = fit(module, _MarkedBatch(x, y, step))
        after = dict(module.named_parameters())
        assert any(not torch.equal(after[n], before[n]) for n in before if n.startswith(moved))
        assert all(torch.equal(after[n], before[n]) for n in before if n.startswith(still))
        # the runtime's loss is step A's CE + L_tc; a step-B batch reports none
        assert meter.steps == (1 if step == STEP_A else 0)
        # either step leaves the classifier trainable (fine-tuning and a user's own optimizer train it next)
        assert all(p.requires_grad for p in module.model.parameters())


def test_epoch_alternation_of_one_batch_is_the_batch_alternation():
    """With one mini-batch per epoch, a pass of A then a pass of B is step A then step B on it: the same bits."""
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])
    states = []
    for alternate in ("batch", "epoch"):
        module = _local_client(alternate)
        torch.manual_seed(0)
        loader = module.stage_dataloader(one_batch_loader(x, y), seed=0)
        assert isinstance(loader, EpochAlternation) == (alternate == "epoch")
        fit(module, loader, max_epochs=2)
        states.append(state_digests(module.state_dict()))
    assert not differing(*states)


EPOCH_ARGS = {"alternate": "epoch", "element_reduction": "mean", "max_grad_norm": 5.0}


def test_epoch_alternation_runs_and_resumes_in_the_round_loop():
    """``alternate="epoch"`` through the loop: two rounds and the fine-tuning, resumed after round 0 exactly.

    With the CPU configs' mean reduction and clipping: at the paper's sum reduction without
    clipping, a whole pass of classifier steps against a VTC that has not yet moved diverges on
    this tiny scenario in round 0, where the per-batch alternation does not (docs/fedvtc.md).
    """

    class Keep:
        state = None

        def on_round_end(self, loop, record):
            if record["round"] == 0:
                Keep.state = saved_and_loaded(loop.checkpoint_state())

        def on_run_end(self, loop, summary):
            pass

    def loop(**kwargs):
        trainer = TrainerTemplate(max_epochs=1, accelerator="cpu")
        return tiny_loop("fedvtc", trainer=trainer, rounds=2, seed=1, method_args=EPOCH_ARGS, **kwargs)

    first = loop(callbacks=[Keep()])
    summary = first.run()
    resumed = loop()
    resumed.load_checkpoint_state(Keep.state)
    resumed.run()
    assert first.algorithm.hp.alternate == "epoch"
    assert all(math.isfinite(r["train/loss"]) for r in first.history if "train/loss" in r)
    assert 0.0 <= summary["final"]["acc_global"] <= 100.0
    for cid in range(first.scenario.num_clients):
        assert not differing(state_digests(first.store.get(cid)), state_digests(resumed.store.get(cid)))


def _context(num_classes: int = 3, latent_dim: int = 2, clients: int = 3, counts=None) -> ServerContext:
    vtc = VTCDecoder((latent_dim, 1, 1), (1, 1, 1), 1)
    state = {
        "latent.log_sigma": torch.zeros(latent_dim),
        "latent.prototypes": torch.zeros(num_classes, latent_dim),
        **{f"vtc.{k}": v for k, v in vtc.state_dict().items()},
    }
    return ServerContext(
        num_clients=clients,
        num_classes=num_classes,
        architectures=("x",) * clients,
        seed=0,
        initial_client_state=lambda cid: state,
        label_counts=counts,
    )


def _stats(classes, prototypes, sigma) -> VTCPayload:
    return VTCPayload(
        classes=torch.tensor(classes), prototypes=torch.tensor(prototypes), sigma=torch.tensor(sigma), num_examples=5
    )


def test_server_averages_prototypes_over_owners_and_sigma_over_uploaders():
    """Class 0: mean of (1, 1) and (3, 5) = (2, 3); class 1 only client 1: (4, 4); class 2 kept (zeros); sigma mean."""
    server = FedVTCServer(finetune_rounds=5)
    counts = torch.tensor([[5, 0, 0], [3, 2, 0], [0, 0, 4]])
    server.setup_server(_context(counts=counts))
    server.aggregate(
        0,
        [
            upload(0, _stats([0], [[1.0, 1.0]], [1.0, 2.0])),
            upload(1, _stats([0, 1], [[3.0, 5.0], [4.0, 4.0]], [3.0, 4.0])),
        ],
    )
    torch.testing.assert_close(server.prototypes, torch.tensor([[2.0, 3.0], [4.0, 4.0], [0.0, 0.0]]))
    torch.testing.assert_close(server.sigma, torch.tensor([2.0, 3.0]))
    # logged prior: mean SD 2.5; norms sqrt(13), sqrt(32), 0; closest pair (2, 3)-(4, 4) at sqrt(5)
    metrics = server.metrics()
    assert metrics["sigma_mean"] == pytest.approx(2.5)
    assert metrics["prototype_norm"] == pytest.approx((13**0.5 + 32**0.5) / 3)
    assert metrics["prototype_min_distance"] == pytest.approx(5**0.5)
    server.aggregate(1, [upload(2, _stats([2], [[7.0, 7.0]], [1.0, 1.0]))])
    torch.testing.assert_close(server.prototypes[0], torch.tensor([2.0, 3.0]))  # nobody owning class 0 uploaded
    torch.testing.assert_close(server.prototypes[2], torch.tensor([7.0, 7.0]))
    # a round's download: the receiver's own classes and sigma, no VTC
    download = server.download_for(1)
    assert download.classes.tolist() == [0, 1] and not download.vtc
    assert download.nbytes() == 2 * 2 * 4 + 2 * 8 + 2 * 4  # (|Y_k| + 1) * p floats plus the class ids


def test_anchor_scale_rescales_the_averaged_prototypes_to_the_anchors_mean_norm():
    """Anchors (3, 4), (0, 1), (0, 0): mean norm 2. Averages (6, 8), (0, 2), kept (0, 0): mean norm 4, so x 1/2."""
    counts = torch.tensor([[5, 5, 0]])
    context = _context(counts=counts, clients=1)
    initial = context.initial_client_state(0)
    initial["latent.prototypes"] = torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]])
    context = dataclasses.replace(context, initial_client_state=lambda cid: initial)
    server = FedVTCServer(finetune_rounds=5, prototype_scale="anchors", initial_prototype_sd=0.1)
    server.setup_server(context)
    server.aggregate(0, [upload(0, _stats([0, 1], [[6.0, 8.0], [0.0, 2.0]], [1.0, 1.0]))])
    torch.testing.assert_close(server.prototypes, torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]]))
    server.aggregate(1, [upload(0, _stats([0, 1], [[0.3, 0.4], [0.0, 0.1]], [1.0, 1.0]))])  # mean norm 0.2: x 10
    torch.testing.assert_close(server.prototypes, torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]]))
    server.aggregate(2, [upload(0, _stats([0, 1], [[0.0, 0.0], [0.0, 0.0]], [1.0, 1.0]))])  # no scale: kept at 0
    assert torch.equal(server.prototypes, torch.zeros(3, 2))
    free = FedVTCServer(finetune_rounds=5)
    free.setup_server(context)
    free.aggregate(0, [upload(0, _stats([0, 1], [[6.0, 8.0], [0.0, 2.0]], [1.0, 1.0]))])
    torch.testing.assert_close(free.prototypes, torch.tensor([[6.0, 8.0], [0.0, 2.0], [0.0, 0.0]]))
    with pytest.raises(ConfigError) as error:
        FedVTC(prototype_scale="anchors")
    assert str(error.value) == (
        "FedVTC: prototype_scale='anchors' needs initial_prototype_sd > 0 (zero prototypes have no scale)"
    )


def test_server_psi_average_of_identical_vtcs_is_the_identity_and_broadcast_is_complete():
    """Averaging identical VTCs changes nothing; the final broadcast has every class; fine-tuning is silent."""
    server = FedVTCServer(finetune_rounds=2)
    server.setup_server(_context())
    reference = clone_state(server.vtc)
    server.phase = VTC_SYNC
    server.aggregate(0, [upload(c, VTCPayload(vtc=clone_state(reference))) for c in range(3)])
    for key, value in reference.items():
        assert torch.equal(server.vtc[key], value), key
    broadcast = server.download_for(0)
    assert broadcast.classes.tolist() == [0, 1, 2] and broadcast.vtc
    # fine-tuning is silent until its last step
    server.phase = FINETUNE
    server.aggregate(0, [])
    assert server.download_for(0) is None
    server.aggregate(1, [])
    assert server.download_for(0) is not None


def test_downloads_over_a_one_round_run():
    """T = 1: round 0 sends the owned classes and sigma; the VTC upload step after round T gets nothing; then all."""
    counts = torch.tensor([[5, 0, 5], [0, 5, 0], [5, 5, 5]])
    server = FedVTCServer(finetune_rounds=2)
    server.setup_server(_context(counts=counts))
    server.total_rounds = 1
    first = server.download_for(0)
    assert first.classes.tolist() == [0, 2] and first.prototypes.shape == (2, 2) and not first.vtc
    assert torch.equal(first.sigma, torch.ones(2))  # the clients' initial SD (log sigma 0 in _context)
    server.aggregate(0, [upload(0, _stats([0, 2], [[1.0, 1.0], [2.0, 2.0]], [0.5, 0.5]))])
    assert server.download_for(0) is None  # the vtc_sync step after round T needs nothing
    server.phase = VTC_SYNC
    server.aggregate(0, [upload(c, VTCPayload(vtc=clone_state(server.vtc))) for c in range(3)])
    assert server.download_for(1).classes.tolist() == [0, 1, 2]


def test_a_latent_prior_starts_at_sigma_one_zero_prototypes_and_no_synthetic_seed():
    """Table 5's start by default; given prototypes are copied, not shared."""
    prior = LatentPrior(3, 2)
    assert torch.equal(prior.log_sigma.detach(), torch.zeros(2)) and torch.equal(prior.prototypes, torch.zeros(3, 2))
    assert prior.synthetic_seed.item() == -1 and prior.synthetic_seed.dtype == torch.long
    anchors = torch.ones(3, 2)
    given = LatentPrior(3, 2, prior_sd=0.1, initial_prototypes=anchors)
    anchors.zero_()
    assert torch.equal(given.prototypes, torch.ones(3, 2))
    assert given.log_sigma.detach() == pytest.approx([math.log(0.1)] * 2)
    assert torch.equal(initial_prototypes(3, 2), torch.zeros(3, 2))
    assert initial_prototypes(3, 2, sd=1.0).abs().sum() > 0  # sd 1: anchors, not zeros
    assert torch.equal(initial_prototypes(3, 2, sd=1.0), initial_prototypes(3, 2, sd=1.0, seed=0))  # seed 0 default


def test_initial_prototypes_are_zeros_or_shared_seeded_anchors_and_the_server_starts_from_them():
    """Zeros at sd = 0 (Table 5); at sd = 0.1 the same N(0, 0.01 I) anchors for every client and the server."""
    assert torch.equal(initial_prototypes(3, 4), torch.zeros(3, 4))
    anchors = initial_prototypes(10, 980, sd=0.1, seed=0)
    assert torch.equal(anchors, initial_prototypes(10, 980, sd=0.1, seed=0))
    assert not torch.equal(anchors, initial_prototypes(10, 980, sd=0.1, seed=1))
    assert anchors.std().item() == pytest.approx(0.1, rel=0.02)
    assert torch.cdist(anchors, anchors)[~torch.eye(10, dtype=torch.bool)].min().item() > 4.0  # ~0.1 * sqrt(2 * 980)
    algorithm = FedVTC(latent_channels=1, vtc_channels=(1, 1, 1), initial_prototype_sd=0.1)
    algorithm.configure(DataFormat(image_size=8, channels=1, mean=(0.0,), std=(1.0,), num_classes=3))
    models = [create_model("cnn_tiny", num_classes=3, in_channels=1, seed=s) for s in (0, 1)]
    clients = [algorithm.build_client(model, 3) for model in models]
    assert torch.equal(clients[0].latent.prototypes, clients[1].latent.prototypes)
    torch.testing.assert_close(clients[0].latent.prototypes, initial_prototypes(3, 4, sd=0.1, seed=0))
    server = algorithm.build_server()
    state = clients[0].state_dict()
    server.setup_server(
        dataclasses.replace(_context(num_classes=3, latent_dim=4), initial_client_state=lambda cid: state)
    )
    assert torch.equal(server.prototypes, clients[0].latent.prototypes)
    assert torch.equal(server.download_for(0).prototypes, clients[0].latent.prototypes)
    reseeded = FedVTC(latent_channels=1, vtc_channels=(1, 1, 1), initial_prototype_sd=0.1, vtc_init_seed=3)
    reseeded.configure(DataFormat(image_size=8, channels=1, mean=(0.0,), std=(1.0,), num_classes=3))
    client = reseeded.build_client(create_model("cnn_tiny", num_classes=3, in_channels=1, seed=0), 3)
    assert torch.equal(client.latent.prototypes, initial_prototypes(3, 4, sd=0.1, seed=3))  # vtc_init_seed's anchors


def test_the_server_refuses_clients_it_cannot_serve():
    """Clients without FedVTC's latent state, and anchor rescaling when the clients start from zero prototypes."""
    with pytest.raises(ConfigError) as error:
        FedVTCServer().setup_server(dataclasses.replace(_context(), initial_client_state=lambda cid: {}))
    assert str(error.value) == "FedVTC's server needs FedVTC clients (no 'latent.prototypes' in the client state)"
    anchored = FedVTCServer(prototype_scale="anchors", initial_prototype_sd=0.1)
    with pytest.raises(ConfigError) as error:
        anchored.setup_server(_context())  # the clients' prototypes are zeros
    assert str(error.value) == (
        "FedVTC: prototype_scale='anchors' needs initial_prototype_sd > 0 (zero prototypes have no scale)"
    )


def test_server_rejects_bad_uploads():
    """Out-of-range classes and non-positive SDs are refused in one line."""
    server = FedVTCServer(finetune_rounds=1)
    server.setup_server(_context())
    with pytest.raises(TrainingError, match="outside"):
        server.check_upload(upload(0, _stats([3], [[1.0, 1.0]], [1.0, 1.0])))
    with pytest.raises(TrainingError, match="non-positive"):
        server.check_upload(upload(0, _stats([0], [[1.0, 1.0]], [0.0, 1.0])))


def _check(server: FedVTCServer, payload, client_id: int = 0) -> str:
    """The one line the server refuses ``payload`` with ("" when accepted)."""
    try:
        server.check_upload(upload(client_id, payload))
    except TrainingError as error:
        return str(error)
    return ""


def test_every_refusal_names_the_client_and_the_problem():
    """Each layout check of a round's upload and a vtc_sync upload, with its exact message."""
    counts = torch.tensor([[5, 5, 0], [0, 5, 5], [5, 0, 5]])
    server = FedVTCServer(finetune_rounds=1)
    server.setup_server(_context(counts=counts))
    good = _stats([0, 1], [[1.0, 1.0], [2.0, 2.0]], [1.0, 1.0])
    assert _check(server, good) == ""
    assert _check(server, Payload(num_examples=5)) == "client 0 sent Payload, expected VTCPayload"
    assert _check(server, dataclasses.replace(good, classes=torch.tensor([0.0, 1.0]))) == (
        "client 0 sent 'classes' of shape (2,) as torch.float32, expected a vector of int64 class indices"
    )
    assert _check(server, dataclasses.replace(good, classes=torch.tensor([[0, 1]]))) == (
        "client 0 sent 'classes' of shape (1, 2) as torch.int64, expected a vector of int64 class indices"
    )
    assert _check(server, dataclasses.replace(good, classes=torch.tensor([1, 1]))) == (
        "client 0 sent class indices that are not distinct integers"
    )
    assert _check(server, dataclasses.replace(good, classes=torch.tensor([-1, 0]))) == (
        "client 0 sent class indices outside [0, 3)"
    )
    assert _check(server, dataclasses.replace(good, classes=torch.tensor([0, 3]))) == (
        "client 0 sent class indices outside [0, 3)"
    )
    assert _check(server, dataclasses.replace(good, classes=torch.tensor([0, 2]))) == (
        "client 0 sent a prototype of class 2, which it holds no example of"
    )
    assert _check(server, _stats([2, 1], [[1.0, 1.0], [2.0, 2.0]], [1.0, 1.0]), client_id=1) == ""
    layout = "; all clients must use the same num_classes / feature layout"
    assert _check(server, dataclasses.replace(good, prototypes=torch.ones(2, 3))) == (
        "client 0 sent 'prototypes' of shape (2, 3), expected (2, 2)" + layout
    )
    assert _check(server, dataclasses.replace(good, prototypes=torch.ones(2, 2).double())).startswith(
        "client 0 sent 'prototypes' as torch.float64 where the server holds torch.float32"
    )
    assert _check(server, dataclasses.replace(good, sigma=torch.ones(3))) == (
        "client 0 sent 'sigma' of shape (3,), expected (2,)" + layout
    )
    assert _check(server, dataclasses.replace(good, prototypes=torch.tensor([[1.0, math.nan], [2.0, 2.0]]))).startswith(
        "client 0 sent non-finite values in 'prototypes'"
    )
    assert _check(server, dataclasses.replace(good, sigma=torch.tensor([1.0, -1.0]))) == (
        "client 0 sent a non-positive SD"
    )
    assert _check(server, dataclasses.replace(good, sigma=torch.zeros(0))) == (
        "client 0 sent no 'sigma', which every upload of phase 'federation' holds"
    )
    no_classes = VTCPayload(sigma=torch.ones(2), num_examples=5)
    assert _check(server, no_classes) == "client 0 sent no 'classes', which every upload of phase 'federation' holds"
    vtc = clone_state(server.vtc)
    assert _check(server, dataclasses.replace(good, vtc=vtc)) == ""  # psi_sync="once": an extra psi is harmless
    server.phase = VTC_SYNC
    assert _check(server, VTCPayload(vtc=vtc, num_examples=5)) == ""
    assert _check(server, VTCPayload(num_examples=5)) == (
        "client 0 sent no 'vtc', which every upload of phase 'vtc_sync' holds"
    )
    first = next(iter(vtc))
    assert _check(server, VTCPayload(vtc={**vtc, first: torch.ones(7)}, num_examples=5)) == (
        f"client 0 sent 'vtc.{first}' of shape (7,), expected {tuple(vtc[first].shape)}" + layout
    )
    assert _check(server, VTCPayload(vtc={k: v for k, v in vtc.items() if k != first}, num_examples=5)) == (
        f"client 0 sent vtc whose keys differ from the VTC (missing ['{first}'], unexpected []); all clients of an "
        "architecture must send the same layout"
    )
    server.phase = FINETUNE
    assert _check(server, VTCPayload(num_examples=5)) == (
        "client 0 sent VTCPayload during fine-tuning, where clients send nothing"
    )
    nan = VTCPayload(classes=torch.tensor([0]), prototypes=torch.tensor([[math.nan, 0.0]]), num_examples=5)
    with pytest.raises(TrainingError) as error:  # the payload's own check, as a server driven by hand calls it
        nan.validate_shape(3, 2, vtc, "client 4")
    assert str(error.value).startswith("client 4 sent non-finite values in 'prototypes'")
    every_round = FedVTCServer(finetune_rounds=1, psi_sync="every_round")
    every_round.setup_server(_context(counts=counts))
    assert _check(every_round, good) == "client 0 sent no 'vtc', which every upload of phase 'federation' holds"
    assert _check(every_round, dataclasses.replace(good, vtc=vtc)) == ""


def test_synthetic_set_has_s_over_c_samples_per_class_decoded_from_its_prototype():
    """S/C labels per class; With sigma ~ 0 and the identity decoder, every synthetic image is its class prototype."""
    client = _client()
    client.hp = dataclasses.replace(client.hp, synthetic_per_class=3)
    client.latent.prototypes.copy_(torch.tensor([[1.0, 2.0], [-1.0, 0.5]]))
    client.latent.log_sigma.data.fill_(-30.0)
    images, labels = client.synthetic_set(seed=0)
    assert labels.tolist() == [0, 0, 0, 1, 1, 1]
    torch.testing.assert_close(images.flatten(1), client.latent.prototypes[labels])
    again, _ = client.synthetic_set(seed=0)
    assert torch.equal(images, again)


def test_the_linear_neck_is_kept_or_built_to_the_latent_size():
    """A Linear neck to dim is kept (same weights); pooling, or a Linear neck to another size, gets a fresh one."""
    kept = create_model("cnn_tiny", num_classes=10, in_channels=1, seed=0, feature_dim=8, feature_proj="linear")
    neck, head = kept.neck, kept.head
    assert linear_feature_projection(kept, 8) is kept and kept.neck is neck and kept.head is head
    for proj, dim in (("pool", 8), ("linear", 12)):
        model = create_model("cnn_tiny", num_classes=10, in_channels=1, seed=0, feature_dim=8, feature_proj=proj)
        linear_feature_projection(model, dim)
        assert isinstance(model.neck, nn.Linear) and (model.neck.in_features, model.neck.out_features) == (16, dim)
        assert (model.head.in_features, model.head.out_features) == (dim, 10) and model.num_features == dim
        assert model.forward_features(torch.rand(2, 1, 8, 8)).shape == (2, dim)
    with pytest.raises(ConfigError) as error:
        linear_feature_projection(nn.Linear(2, 2), 8)
    assert str(error.value) == "FedVTC needs FeatureClassifier backbones (missing 'neck')"


def test_an_unconfigured_fedvtc_builds_the_mnist_latent_and_identity_pixels():
    """Without a data format (a user building clients by hand): 28-pixel images, pixels as given."""
    algorithm = FedVTC()
    assert algorithm.latent_shape() == (20, 7, 7)
    client = algorithm.build_client(create_model("cnn_tiny", num_classes=10, in_channels=1, seed=0), 10)
    assert client.pixel_mean.flatten().tolist() == [0.0] and client.pixel_std.flatten().tolist() == [1.0]
    assert client.model.num_features == 980


def test_every_client_starts_from_the_vtc_of_vtc_init_seed():
    """One seed, one VTC (whatever the global RNG); another seed, another VTC."""
    def vtc(seed: int) -> dict:
        torch.manual_seed(seed + 100)
        return FedVTC(vtc_init_seed=seed).build_vtc().state_dict()

    assert not differing(state_digests(vtc(0)), state_digests(vtc(0)))
    assert differing(state_digests(vtc(0)), state_digests(vtc(1)))


def test_bad_configuration_fails_in_one_line():
    """An image size the VTC cannot reach and a wrong channel list are ConfigErrors."""
    algorithm = FedVTC()
    algorithm.configure(DataFormat(image_size=30, channels=3, mean=(0.0,) * 3, std=(1.0,) * 3, num_classes=10))
    with pytest.raises(ConfigError, match="multiple of 4"):
        algorithm.build_vtc()
    with pytest.raises(ConfigError, match="vtc_channels"):
        FedVTC(vtc_channels=(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as error:
        FedVTC(vtc_out_channels=2).build_vtc()
    assert str(error.value) == "FedVTC: vtc_out_channels=2 must be 1 or the images' 3 channels"


# ---------------------------------------------------------------------- runs of the tiny scenario
def test_measured_traffic_matches_the_formula():
    """Rounds: 2 (|Y_k| + 1) p floats (+ class ids); end: |psi| up, |psi| + (C + 1) p down (+ ids), per client."""
    loop = tiny_loop("fedvtc", trainer=TrainerTemplate(max_steps=1, accelerator="cpu"), rounds=2)
    loop.run()
    p = loop.runtime.module(loop.architectures[0]).latent.prototypes.shape[1]
    owned = (loop.runtime.label_counts() > 0).sum(1)
    vtc_bytes = sum(v.numel() * v.element_size() for v in loop.server.vtc.values())
    rounds_up = sum(int(owned[c]) * (4 * p + 8) + 4 * p for c in range(3)) * 2  # all 3 clients, 2 rounds
    history = loop.history
    assert sum(r["comm/bytes_up"] for r in history[:2]) == rounds_up
    assert sum(r["comm/bytes_down"] for r in history[:2]) == rounds_up
    assert history[2]["phase"] == VTC_SYNC and history[2]["comm/bytes_up"] == 3 * vtc_bytes
    assert history[2]["comm/bytes_down"] == 0  # nothing is sent before the VTC upload
    assert history[3]["comm/bytes_down"] == 3 * (vtc_bytes + 4 * 10 * p + 8 * 10 + 4 * p)
    assert all(r["comm/bytes_up"] == 0 for r in history[3:]) and all(r["comm/bytes_down"] == 0 for r in history[4:])


def _run(psi_sync: str):
    from fedhet.algorithms import ALGORITHMS
    from fedhet.federation import FederationLoop
    from fedhet.models import resolve_family
    from tests.conftest import tiny_label_skew

    scenario = tiny_label_skew()
    scenario.setup()
    models = resolve_family("tiny2")
    algorithm = ALGORITHMS["fedvtc"](**{**FAST["fedvtc"], "psi_sync": psi_sync})
    loop = FederationLoop(
        algorithm,
        scenario,
        [models[c % 2] for c in range(3)],
        TrainerTemplate(max_steps=1, accelerator="cpu"),
        rounds=2,
        feature_dim=16,
    )
    loop.run()
    return loop


def test_per_round_psi_sync_uploads_psi_every_round_and_costs_more():
    """Table 3: averaging psi every round adds 2 |psi| per participant and round."""
    once, every = _run("once"), _run("every_round")
    vtc_bytes = sum(v.numel() * v.element_size() for v in once.server.vtc.values())
    assert every.ledger.total_up - once.ledger.total_up == 2 * 3 * vtc_bytes
    assert every.ledger.total_down - once.ledger.total_down == 1 * 3 * vtc_bytes  # round 2's download only


class _CheckpointAt:
    def __init__(self, step: int) -> None:
        self.step = step
        self.state = None

    def on_round_end(self, loop, record) -> None:
        if record["round"] == self.step:
            self.state = saved_and_loaded(loop.checkpoint_state())

    def on_run_end(self, loop, summary) -> None:
        pass


def test_resume_in_the_middle_of_fine_tuning_equals_the_uninterrupted_run():
    """Schedule: 1 round, vtc_sync, 2 fine-tuning steps; resume after the first fine-tuning step."""
    trainer = TrainerTemplate(max_steps=1, accelerator="cpu")
    first = tiny_loop("fedvtc", trainer=trainer, rounds=1, seed=5)
    first.run()
    assert [s.phase for s in first.schedule] == ["federation", VTC_SYNC, FINETUNE, FINETUNE]
    checkpoint = _CheckpointAt(2)
    second = tiny_loop("fedvtc", trainer=trainer, rounds=1, seed=5, callbacks=[checkpoint])
    second.run()
    resumed = tiny_loop("fedvtc", trainer=trainer, rounds=1, seed=5)
    resumed.load_checkpoint_state(checkpoint.state)
    assert resumed.next_round == 3
    summary = resumed.run()
    for cid in range(3):
        assert not differing(state_digests(first.store.get(cid)), state_digests(resumed.store.get(cid))), cid
    assert not differing(state_digests(first.server.server_state()), state_digests(resumed.server.server_state()))
    strip = lambda history: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in history]  # noqa: E731
    assert strip(resumed.history) == strip(first.history)
    assert summary["comm"] == first.summary()["comm"]


@pytest.mark.usefixtures("one_thread")  # its 40% threshold was measured on one thread; two sum in another order
@pytest.mark.parametrize(
    "prior_sd, kl_weight, above_chance",
    [(0.1, 0.01, True), pytest.param(1.0, 1.0, False, marks=pytest.mark.slow)],  # the oracles pin the wiring
)
def test_synthetic_digits_are_recognised_by_a_held_out_model_above_chance(prior_sd, kl_weight, above_chance):
    """Synthetic digits decoded from the final psi, prototypes and sigma are recognised above chance.

    One client holding every digit trains FedVTC with the shipped CPU settings; a classifier trained
    only on the held-out global test digits (never seen by FedVTC) scores 20 digits per class. With
    the paper's unit prior (``prior_sd=1``: sigma = 1 noise swamps features of size ~0.1) the VTC
    collapses to the mean digit and the same check scores chance (the second case).
    """
    from fedhet.algorithms import ALGORITHMS
    from fedhet.data import DirichletPartitioner, LabelSkewScenario
    from fedhet.federation import FederationLoop
    from fedhet.functional.vtc import reparameterize

    scenario = LabelSkewScenario(  # all 4,000 training digits on one client; the 1,000 test digits held out
        dataset="mnist_all",
        num_clients=1,
        partitioner=DirichletPartitioner(beta=100.0, min_size=1),
        pool_train_test=False,
        global_test_size=None,
        global_val_size=100,
        image_size=28,
        batch_size=16,
        seed=0,
    )
    scenario.setup()
    algorithm = ALGORITHMS["fedvtc"](
        vtc_out_channels=1, element_reduction="mean", vtc_lr=0.1, lr=0.05, momentum=0.9, max_grad_norm=5.0,
        finetune_rounds=1, finetune_epochs=1, prior_sd=prior_sd, kl_weight=kl_weight,
    )
    trainer = TrainerTemplate(max_steps=200, accelerator="cpu")  # 3 rounds x 200 steps, then psi and fine-tuning
    loop = FederationLoop(algorithm, scenario, ["simple_cnn"], trainer, rounds=3, seed=0)
    loop.run()
    server = loop.server
    decoder = algorithm.build_vtc()
    decoder.load_state_dict(server.vtc)  # the averaged psi of the final broadcast
    decoder.eval()
    labels = torch.arange(10).repeat_interleave(20)
    noise = torch.randn(len(labels), server.prototypes.shape[1], generator=torch.Generator().manual_seed(0))
    client = loop.runtime.module("simple_cnn")
    with torch.no_grad():
        images = client.model_input(decoder(reparameterize(server.prototypes[labels], server.sigma.log(), noise)))
    test = next(iter(scenario.eval_sets("test").values()))
    x, y = (torch.cat(t) for t in zip(*scenario.eval_loader(test), strict=True))
    held_out = create_model("simple_cnn", num_classes=10, in_channels=3, seed=1)
    optimizer = torch.optim.Adam(held_out.parameters(), lr=0.003)
    generator = torch.Generator().manual_seed(0)
    for _ in range(8):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), 50):
            index = order[start : start + 50]
            optimizer.zero_grad()
            F.cross_entropy(held_out(x[index]), y[index]).backward()
            optimizer.step()
    held_out.eval()
    with torch.no_grad():
        recognised = (held_out(images).argmax(1) == labels).float().mean().item()
    print(f"recognised {recognised:.3f}")
    if above_chance:
        assert recognised > 0.4, f"only {recognised:.0%} of the synthetic digits recognised (chance 10%)"
    else:
        assert recognised < 0.2, f"{recognised:.0%} recognised: the unit prior no longer collapses the VTC"


class _NormedLinear(TinyLinear):
    """TinyLinear with a BatchNorm on its features, whose running statistics start at mean 0, var 1."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(2)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x.flatten(1)))


@pytest.mark.parametrize("finetune_bn, moved", [("train", True), ("frozen", False)])
def test_frozen_finetune_bn_keeps_the_real_data_running_statistics(finetune_bn, moved):
    """Frozen BatchNorm keeps the running statistics of real data; the weights still train.

    A fine-tuning step on a batch of mean (5, -5) moves the running mean by momentum 0.1 to
    (0.5, -0.5) in train mode; frozen, it stays at (0, 0).
    """
    client = FedVTCClient(_NormedLinear(), 2, vtc=_LinearDecoder(), finetune_bn=finetune_bn)  # type: ignore[arg-type]
    client.stage = FINETUNE
    client.train()
    x = torch.tensor([[4.0, -4.0], [6.0, -6.0]]).reshape(2, 1, 1, 2)
    loss = client.training_step((x, torch.tensor([0, 1])), 0)
    loss.backward()
    expected = torch.tensor([0.5, -0.5]) if moved else torch.zeros(2)
    assert torch.allclose(client.model.norm.running_mean, expected)
    assert client.model.head.weight.grad is not None and client.model.head.weight.grad.abs().sum() > 0
