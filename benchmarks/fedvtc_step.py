"""What one FedVTC local step costs against a plain cross-entropy step of the same model.

FedVTC's local step (Section 3.4, Algorithm 1) alternates per mini-batch: (A) the classifier
steps on ``CE + L_tc``, where ``L_tc`` decodes the features with the VTC and, for ``L_dm``, passes
the decoded images through the extractor again; (B) the VTC and sigma step on ``L_tc`` with a fresh
forward. That is four forward and three backward passes of the classifier and two of the VTC per
batch, against one of each for the baselines. This script measures the ratio per model of the ``mnist_vtc``
family, with the configs' settings (p = 980, the MNIST VTC, batch 16, 28x28 digits, SGD 0.05 /
0.9, clipping at 5, ``element_reduction: mean``): the real ``FedVTCClient.training_step`` and the
base ``ClientModule`` step, each run by a plain Lightning ``Trainer`` for the same number of
steps after a warm-up fit. It explains why ``configs/experiments/mnist_vtc/fedvtc.yaml`` takes
several times FedProto's time at the same schedule (docs/fedvtc.md, "Runtime at T = 20").

Run: ``python benchmarks/fedvtc_step.py [--steps 60] [--threads 1] [--models simple_cnn resnet4 ...]``.
The last line printed is ``ratio <mean over models of FedVTC step / plain step>``.
"""

from __future__ import annotations

import argparse
import time

import lightning
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms.base import ClientModule
from fedhet.algorithms.fedvtc import FedVTCClient, VTCDecoder, linear_feature_projection
from fedhet.federation.trainer import MemoryFormat, apply_memory_format, silence_lightning
from fedhet.models import create_model, resolve_family

BATCH = 16
LATENT = (20, 7, 7)  # p = 980
OPTIMIZER = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}


def build(kind: str, model_name: str) -> lightning.LightningModule:
    """A FedVTC client (the configs' settings) or a plain client of the same model with the p = 980 neck."""
    torch.manual_seed(0)
    model = linear_feature_projection(create_model(model_name, num_classes=10, in_channels=3), 980)
    if kind == "plain":
        return ClientModule(model, 10, **OPTIMIZER)
    return FedVTCClient(
        model, 10, VTCDecoder(LATENT, (16, 32, 32), 1), pixel_mean=(0.5,) * 3, pixel_std=(0.5,) * 3,
        prior_sd=0.1, kl_weight=0.1, initial_prototype_sd=0.1, element_reduction="mean", vtc_lr=0.1,
        max_grad_norm=5.0, **OPTIMIZER,
    )


def seconds_per_step(kind: str, model_name: str, steps: int, memory_format: MemoryFormat = "contiguous") -> float:
    """Wall seconds per training step of a ``Trainer`` fit of ``steps`` batches, after a warm-up fit.

    ``memory_format`` lays the module out as ``trainer.memory_format`` does in a run.
    """
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * BATCH, 3, 28, 28, generator=generator),
                         torch.randint(0, 10, (steps * BATCH,), generator=generator))
    module = apply_memory_format(build(kind, model_name), memory_format)

    def fit(limit: int) -> float:
        # limit_train_batches counts batches: max_steps would count optimizer steps, two per batch
        # in FedVTC's manual step (A and B), and so time half as many of its batches
        trainer = lightning.Trainer(max_epochs=1, limit_train_batches=limit, accelerator="cpu", logger=False,
                                    enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False)
        started = time.perf_counter()
        trainer.fit(module, DataLoader(data, batch_size=BATCH, shuffle=False))
        return time.perf_counter() - started

    fit(5)
    return fit(steps) / steps


def step_timing_setup(description: str, steps: int) -> argparse.Namespace:
    """Parse ``--steps --threads --models`` (the 28x28 ``vtc_mnist5`` models), quiet Lightning, set the threads.

    Shared by the step benchmarks (this one and ``memory_format.py``); prints the settings line.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (configs' workers, pages: 1)")
    parser.add_argument("--models", nargs="+", default=list(resolve_family("vtc_mnist5")), help="28x28 models")
    args = parser.parse_args()
    silence_lightning()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, batch {BATCH}, {args.steps} steps per fit (after a 5-step warm-up fit)")
    return args


def main() -> None:
    """Time both steps for every model and print the ratios."""
    args = step_timing_setup(__doc__.splitlines()[0], steps=60)
    print(f"{'model':18s} {'plain ms':>9s} {'FedVTC ms':>10s} {'ratio':>6s}")
    ratios = []
    for name in args.models:
        plain = seconds_per_step("plain", name, args.steps)
        vtc = seconds_per_step("fedvtc", name, args.steps)
        ratios.append(vtc / plain)
        print(f"{name:18s} {plain * 1e3:9.2f} {vtc * 1e3:10.2f} {vtc / plain:6.2f}")
    print(f"ratio {sum(ratios) / len(ratios):.2f}")


if __name__ == "__main__":
    main()
