"""The metric definitions of design.md section 4 on hand-built matrices."""

import pytest
import torch

from fedhet.metrics import BestTracker, ClientSetAccuracy, intra_inter_accuracy, local_accuracy, topk_correct
from fedhet.metrics.report import domain_shift_metrics, label_skew_metrics, mean_last


def test_intra_inter_on_hand_matrix():
    """Intra accuracy is each client's own-domain column, inter the mean of the others (hand matrix)."""
    A = torch.tensor([[0.9, 0.2, 0.4, 0.6], [0.3, 0.8, 0.1, 0.2], [0.5, 0.5, 0.7, 0.5]])
    intra, inter = intra_inter_accuracy(A, torch.tensor([0, 1, 2]))
    assert torch.allclose(intra, torch.tensor([0.9, 0.8, 0.7]))
    assert torch.allclose(inter, torch.tensor([(0.2 + 0.4 + 0.6) / 3, (0.3 + 0.1 + 0.2) / 3, 0.5]))


def test_domain_shift_metrics_percent_and_per_domain():
    """Domain-shift metrics are percentages, averaged over clients and per domain."""
    A = torch.tensor([[0.9, 0.3], [0.2, 0.6], [0.8, 0.1]])
    result = {"top1": A, "top5": torch.ones_like(A)}
    own = torch.tensor([0, 1, 0])  # two clients on domain 0
    m = domain_shift_metrics(result, own, ["a", "b"])
    assert m["acc_intra"] == pytest.approx(100 * (0.9 + 0.6 + 0.8) / 3)
    assert m["acc_inter"] == pytest.approx(100 * (0.3 + 0.2 + 0.1) / 3)
    assert m["domain/a/acc_intra"] == pytest.approx(100 * (0.9 + 0.8) / 2)
    assert m["domain/a/acc_inter"] == pytest.approx(100 * (0.3 + 0.1) / 2)
    assert m["domain/b/acc"] == pytest.approx(100 * (0.3 + 0.6 + 0.1) / 3)
    assert m["acc_inter_top5"] == 100.0


def test_local_accuracy_pooled_vs_mean():
    """Local accuracy pooled over examples differs from the mean (and std) over clients."""
    out = local_accuracy(torch.tensor([9.0, 1.0, 30.0]), torch.tensor([10.0, 10.0, 40.0]))
    assert out["pooled"] == pytest.approx(40 / 60)
    per = torch.tensor([0.9, 0.1, 0.75])
    assert out["mean"] == pytest.approx(float(per.mean()))
    assert out["std"] == pytest.approx(float(per.std(unbiased=False)))


def test_label_skew_metrics():
    """Label-skew metrics: pooled and mean local accuracy, mean global accuracy, by hand."""
    top1 = torch.tensor([[0.9, 0.5], [0.1, 0.3]])
    total = torch.tensor([[10.0, 100.0], [30.0, 100.0]])
    m = label_skew_metrics({"top1": top1, "top5": top1, "total": total})
    assert m["acc_local"] == pytest.approx(100 * (9 + 3) / 40)
    assert m["acc_local_mean"] == pytest.approx(50.0)
    assert m["acc_global"] == pytest.approx(40.0)


def test_topk_and_metric_accumulation():
    """Top-k correct counts and their accumulation per client and evaluation set."""
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.05, 0.15], [0.2, 0.3, 0.5]])
    target = torch.tensor([1, 2, 0])
    assert topk_correct(logits, target, (1, 2, 5)).tolist() == [1, 2, 3]
    metric = ClientSetAccuracy(2, 2)
    metric.update(topk_correct(logits, target), target.numel(), client=1, eval_set=0)
    metric.update(topk_correct(logits[:1], target[:1]), 1, client=1, eval_set=0)
    out = metric.compute()
    assert out["top1"][1, 0].item() == pytest.approx(2 / 4)
    assert out["total"][0].sum() == 0


def test_best_tracker_selects_on_validation_not_test():
    """The best round is chosen on validation accuracy, ties keeping the earliest."""
    tracker = BestTracker("label_skew")
    tracker.update(0, {"acc_local": 90.0, "val/acc_local": 50.0, "acc_global": 1.0, "val/acc_global": 1.0})
    tracker.update(1, {"acc_local": 10.0, "val/acc_local": 60.0, "acc_global": 2.0, "val/acc_global": 1.0})
    best = tracker.summary()
    assert best["acc_local"] == 10.0 and best["acc_local_round"] == 1  # higher val, lower test
    assert best["acc_global"] == 1.0 and best["acc_global_round"] == 0  # ties keep the earliest


def test_mean_last():
    """The last-3 mean skips rounds without the metric."""
    history = [{"a": 1.0}, {"x": 0}, {"a": 2.0}, {"a": 4.0}, {"a": 6.0}]
    assert mean_last(history, ["a"], 3) == {"a": 4.0}
