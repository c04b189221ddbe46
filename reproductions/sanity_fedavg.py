"""Sanity checks of the platform's numbers (not a speed benchmark).

1. FedAvg on an IID split of the embedded MNIST over 10 clients, homogeneous models, against
   centralised training of the same model on the union of the clients' training data with the
   same optimizer, batch size and number of passes over the data (rounds x local epochs).
2. FedAvg against Local under Dirichlet(0.1) label skew: global accuracy (each client's model on
   the global test set) should be far higher with FedAvg.

Prints a markdown table; ``docs/performance.md`` records the figures and this command.

Run: ``python reproductions/sanity_fedavg.py [--rounds 20] [--epochs 1] [--model simple_cnn] [--seeds 0 1 2]``
"""

from __future__ import annotations

import argparse
import logging
import statistics

import torch
from lightning.pytorch.utilities.seed import isolate_rng

from fedhet.algorithms import FedAvg, Local
from fedhet.algorithms.base import ClientModule
from fedhet.data import DirichletPartitioner, IIDPartitioner, LabelSkewScenario, TensorBatchLoader, concat_tensor_data
from fedhet.federation import FederationLoop, FederationSettings, TrainerTemplate
from fedhet.federation.trainer import silence_lightning
from fedhet.models import create_model


def scenario(partitioner, seed: int) -> LabelSkewScenario:
    """10 clients of the embedded MNIST split by ``partitioner``, set up."""
    built = LabelSkewScenario(dataset="mnist", num_clients=10, partitioner=partitioner, image_size=28, batch_size=32,
                              seed=seed)
    built.setup()
    return built


def federated(algorithm, data: LabelSkewScenario, model: str, rounds: int, epochs: int, seed: int) -> dict:
    """One federated run of ``algorithm``; its final metrics."""
    loop = FederationLoop(
        algorithm, data, [model] * data.num_clients, TrainerTemplate(max_epochs=epochs, accelerator="cpu"),
        rounds=rounds, seed=seed, settings=FederationSettings(eval_every=rounds),
    )
    return loop.run()["final"]


def centralised(data: LabelSkewScenario, model: str, passes: int, lr: float, seed: int) -> float:
    """The same model trained on the union of all clients' training splits; accuracy on the global test set."""
    pooled = concat_tensor_data([data.client_data(c).train for c in range(data.num_clients)])
    with isolate_rng():
        torch.manual_seed(seed)
        module = ClientModule(create_model(model, data.num_classes, data.in_channels, seed=seed), data.num_classes,
                              optimizer="sgd", lr=lr, momentum=0.9)
        loader = TensorBatchLoader(pooled, batch_size=data.batch_size, shuffle=True, seed=seed,
                                   mean=data.mean, std=data.std)
        TrainerTemplate(max_epochs=passes, accelerator="cpu").build().fit(module, train_dataloaders=loader)
    module.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in data.eval_loader(data.eval_sets("test")["global"]):
            correct += int((module(x).argmax(1) == y).sum())
            total += y.numel()
    return 100.0 * correct / total


def main() -> None:
    """Centralised, FedAvg and Local at each seed, then the table of means."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--model", default="simple_cnn")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    silence_lightning()
    logging.getLogger("fedhet").setLevel(logging.WARNING)
    settings = ("central", "fedavg_iid", "fedavg_dir", "local_dir", "fedavg_dir_local", "local_dir_local")
    rows: dict[str, list[float]] = {k: [] for k in settings}
    for seed in args.seeds:
        iid = scenario(IIDPartitioner(), seed)
        rows["central"].append(centralised(iid, args.model, args.rounds * args.epochs, args.lr, seed))
        on_iid = federated(FedAvg(lr=args.lr, momentum=0.9), iid, args.model, args.rounds, args.epochs, seed)
        rows["fedavg_iid"].append(on_iid["acc_global"])
        skew = scenario(DirichletPartitioner(beta=0.1, min_size=20), seed)
        fedavg = federated(FedAvg(lr=args.lr, momentum=0.9), skew, args.model, args.rounds, args.epochs, seed)
        local = federated(Local(lr=args.lr, momentum=0.9), skew, args.model, args.rounds, args.epochs, seed)
        rows["fedavg_dir"].append(fedavg["acc_global"])
        rows["local_dir"].append(local["acc_global"])
        rows["fedavg_dir_local"].append(fedavg["acc_local"])
        rows["local_dir_local"].append(local["acc_local"])
        print(f"seed {seed}: " + "  ".join(f"{k} {v[-1]:.2f}" for k, v in rows.items()), flush=True)

    def cell(values: list[float]) -> str:
        return f"{statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}"

    print(f"\n{args.model}, 10 clients, {args.rounds} rounds x {args.epochs} local epochs, "
          f"SGD lr {args.lr} momentum 0.9, "
          f"batch 32, seeds {args.seeds}\n")
    print("| setting | global test accuracy (%) | local accuracy (%) |")
    print("| --- | --- | --- |")
    epochs = args.rounds * args.epochs
    print(f"| centralised (same model, union of client data, {epochs} epochs) | {cell(rows['central'])} | |")
    print(f"| FedAvg, IID | {cell(rows['fedavg_iid'])} | |")
    print(f"| FedAvg, Dirichlet 0.1 | {cell(rows['fedavg_dir'])} | {cell(rows['fedavg_dir_local'])} |")
    print(f"| Local, Dirichlet 0.1 | {cell(rows['local_dir'])} | {cell(rows['local_dir_local'])} |")


if __name__ == "__main__":
    main()
