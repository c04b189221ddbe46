"""FedL2G's client stages, meta stage bookkeeping and server, by hand (the oracle pins the step values)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms import FedL2GFeat, FedL2GLogit
from fedhet.algorithms.fedl2g import META, FedL2GFeatClient, FedL2GFeatServer, FedL2GLogitServer
from fedhet.core.payloads import ClassStatsPayload
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation.trainer import silence_lightning
from tests.algorithms.helpers import (
    TinyLinear,
    assert_sized_by_client_zeros_head,
    context,
    fit,
    head_context,
    one_batch_loader,
    upload,
)

X, Y = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]), torch.tensor([0, 1, 1])
GUIDE = torch.tensor([[0.5, 0.0], [0.0, 1.0]])


def _client(**hp) -> FedL2GFeatClient:
    return FedL2GFeatClient(TinyLinear(), 2, **hp)


def test_fedl2g_client_without_guidance_trains_on_cross_entropy_and_uploads_nothing():
    """Before a download (or after an empty one) the loss is CE; with guidance it adds ``w MSE(z, g_y)``."""
    client = _client(guide_weight=2.0)
    ce = F.cross_entropy(X, Y)  # TinyLinear: features = logits = x
    assert torch.equal(client.local_loss((X, Y)), ce)
    assert client.make_upload([]) is None
    client.on_receive(None)
    assert torch.equal(client.local_loss((X, Y)), ce)
    client.on_receive(ClassStatsPayload(values=GUIDE, counts=torch.ones(2, dtype=torch.long)))
    pull = ((X - GUIDE[Y]) ** 2).mean()  # (0.25 + 0 + 0 + 1 + 1 + 0) / 6
    assert client.local_loss((X, Y)).item() == pytest.approx((ce + 2.0 * pull).item(), abs=1e-6)


def test_fedl2g_meta_stage_takes_study_then_quiz_batches_reusing_a_short_loader():
    """The meta loader: ``meta_study_batches + meta_quiz_batches`` batches, a short loader passed again."""
    client = _client(meta_study_batches=2, meta_quiz_batches=1)
    private = [("a",), ("b",)]
    assert client.stage_dataloader(private, seed=0) is private  # the local stage trains on the private data
    client.stage = META
    assert list(client.stage_dataloader(private, seed=0)) == [("a",), ("b",), ("a",)]
    assert len(client.stage_dataloader([("a",)] * 5, seed=0)) == 3
    with pytest.raises(TrainingError) as error:
        client.stage_dataloader([], seed=0)
    assert str(error.value) == "FedL2G's meta stage got an empty training loader; the client has no data"


def test_fedl2g_meta_stage_optimizer_is_plain_sgd_and_the_local_one_the_clients():
    """Never stepped, the meta optimizer only carries the virtual step's lr and decay; local training keeps momentum."""
    client = _client(lr=0.2, weight_decay=0.01, momentum=0.9)
    local = client.configure_optimizers()
    assert local.param_groups[0]["momentum"] == 0.9
    client.stage = META
    meta = client.configure_optimizers()
    assert isinstance(meta, torch.optim.SGD) and meta.param_groups[0]["momentum"] == 0
    assert (meta.param_groups[0]["lr"], meta.param_groups[0]["weight_decay"]) == (0.2, 0.01)
    assert client.virtual_step_settings() == (0.2, 0.01)  # outside a Trainer: the declared values


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def _meta_fit(client, batches, callbacks=(), logger=False):
    silence_lightning()
    client.stage = META
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=logger, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=list(callbacks))  # fmt: skip
    trainer.fit(client, client.stage_dataloader(batches, seed=0))
    return trainer


def test_fedl2g_meta_stage_reports_the_study_loss_then_plain_quiz_losses_then_the_stepped_quiz_loss(tmp_path):
    """Study batch: CE + pull (no step); first quiz batch: CE; last quiz batch: the quiz loss after the virtual step."""
    from lightning.pytorch.loggers import CSVLogger

    client = _client(meta_study_batches=1, meta_quiz_batches=2, guide_weight=2.0)
    client.on_receive(ClassStatsPayload(values=GUIDE, counts=torch.ones(2, dtype=torch.long)))
    study, quiz1, quiz2 = (X, Y), (X[:2], Y[:2]), (X[1:], Y[1:])
    recorder = _Recorder()
    trainer = _meta_fit(client, [study, quiz1, quiz2], [recorder], logger=CSVLogger(tmp_path))
    assert float(trainer.logged_metrics["train/loss_step"]) == pytest.approx(recorder.losses[-1], rel=1e-6)
    pull = ((X - GUIDE[Y]) ** 2).mean()
    assert recorder.losses[0] == pytest.approx((F.cross_entropy(X, Y) + 2.0 * pull).item(), abs=1e-6)
    assert recorder.losses[1] == pytest.approx(F.cross_entropy(X[:2], Y[:2]).item(), abs=1e-6)
    assert recorder.losses[2] == pytest.approx(client.learn_to_guide([study], [quiz1, quiz2]).item(), abs=1e-6)
    assert client.make_upload([]).counts.tolist() == [1, 1]


def test_fedl2g_each_meta_stage_starts_afresh():
    """A second meta stage computes its gradient from its own batches alone; without guidance it uploads nothing."""
    first, fresh = _client(), _client()
    for client in (first, fresh):
        client.on_receive(ClassStatsPayload(values=GUIDE, counts=torch.ones(2, dtype=torch.long)))
    _meta_fit(first, [(X, Y), (X, Y)])
    other = [(X[:1], Y[:1]), (X[1:], Y[1:])]
    _meta_fit(first, other)
    _meta_fit(fresh, other)
    assert torch.equal(first.make_upload([]).values, fresh.make_upload([]).values)
    assert first.make_upload([]).counts.tolist() == [1, 0]  # only class 0 was studied
    first.on_receive(None)
    _meta_fit(first, other)
    assert first.make_upload([]) is None


def test_fedl2g_virtual_step_passes_unused_parameters_through():
    """A parameter the forward never reads has no gradient: the virtual step leaves it as it is."""
    model = TinyLinear()
    model.unused = nn.Parameter(torch.ones(1))
    client = FedL2GFeatClient(model, 2)
    client.on_receive(ClassStatsPayload(values=GUIDE, counts=torch.ones(2, dtype=torch.long)))
    loss = client.learn_to_guide([(X, Y)], [(X, Y)])
    assert loss.ndim == 0 and client.make_upload([]).values.shape == (2, 2)


def test_fedl2g_local_training_also_applies_the_trainers_clipping():
    """``max_grad_norm`` clips first (off here), then Lightning's own ``gradient_clip_val`` (0.5)."""
    client = _client(lr=1.0, max_grad_norm=None)
    before = torch.cat([p.detach().flatten().clone() for p in client.parameters()])
    fit(client, one_batch_loader(X, Y * 0), gradient_clip_val=0.5, max_steps=1)
    moved = torch.cat([p.detach().flatten() for p in client.parameters()]) - before
    assert float(moved.norm()) == pytest.approx(0.5, rel=1e-5)


def test_fedl2g_clipping_norms_must_be_positive_or_null():
    """Both clipping norms are positive numbers or null (no clipping), checked by their declarations."""
    for name in ("max_grad_norm", "server_max_grad_norm"):
        with pytest.raises(ConfigError, match=rf"^FedL2GFeat: {name}=0.0 is not a number > 0 or null$"):
            FedL2GFeat(**{name: 0.0})
        FedL2GFeat(**{name: None})


def test_fedl2g_server_draws_its_guidance_from_the_run_seed_and_reports_guided_classes():
    """The initial guidance is N(0, 1) under the run's seed; no class is guided before the first round."""
    def guide(seed, server_type=FedL2GFeatServer):
        server = server_type()
        server.setup_server(context(num_classes=2, seed=seed, initial=head_context(2, 3).initial_client_state(0)))
        assert server.metrics() == {"guided_classes": 0.0}
        return server.download_for(0)

    download = guide(0)
    assert download.values.shape == (2, 3) and download.counts.dtype == torch.long
    assert download.counts.tolist() == [1, 1]
    assert torch.equal(guide(0).values, download.values) and not torch.equal(guide(1).values, download.values)
    assert guide(0, FedL2GLogitServer).values.shape == (2, 2)


def test_fedl2g_feature_server_reads_client_zeros_head():
    """The feature guidance is as wide as client 0's head input; a model without a linear head is refused."""
    message = "FedL2G-feat needs client models with a linear 'head' (FeatureClassifier)"
    assert_sized_by_client_zeros_head(FedL2GFeatServer, message)


def test_fedl2g_server_refuses_float64_gradients_and_accepts_any_rows_without_label_counts():
    """Gradients in the guidance's float32 only; without label counts any 0/1 row marks pass."""
    server = FedL2GLogit().build_server()
    server.setup_server(context(num_classes=2))
    rows = torch.tensor([1, 1])
    server.check_upload(upload(0, ClassStatsPayload(values=torch.zeros(2, 2), counts=rows)))
    with pytest.raises(TrainingError) as error:
        server.check_upload(upload(1, ClassStatsPayload(values=torch.zeros(2, 2).double(), counts=rows)))
    assert str(error.value).startswith("client 1 sent 'values' as torch.float64 where the server holds torch.float32")


def test_fedl2g_server_state_restores_the_guided_classes():
    """A resumed server reports the classes the last round guided."""
    server = FedL2GLogitServer()
    server.setup_server(context(num_classes=2))
    server.aggregate(0, [upload(0, ClassStatsPayload(values=torch.ones(2, 2), counts=torch.tensor([1, 0])))])
    restored = FedL2GLogitServer()
    restored.setup_server(context(num_classes=2))
    restored.load_server_state(server.server_state())
    assert restored.metrics() == server.metrics() == {"guided_classes": 1.0}
