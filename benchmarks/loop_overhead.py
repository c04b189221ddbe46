"""Round-loop overhead: fedhet's FedAvg against a plain PyTorch loop doing the same local steps.

Both run in this process on the embedded label-skew scenario (MNIST, Dirichlet 0.1, 10 clients),
with the same models (``--model``, default the CPU family's resnet12_tiny), the same initial
weights, the same batches in the same order (the same seeded loaders), the same optimizer and
hyperparameters, and optimizer state carried across rounds in both. The plain loop is what a
researcher would write by hand: load the global weights, iterate the batches, step, average.

fedhet's time counts everything its round loop does (sampling, state store, Trainer
construction, ``fit``, uploads with validation, aggregation, bookkeeping) in rounds without
evaluation; the plain loop has no evaluation either. The two final global models are compared to show the
work was the same. The last line printed is ``ratio <fedhet time / plain time>``.

Run: ``python benchmarks/loop_overhead.py [--rounds 3] [--epochs 1] [--repeats 5] [--threads 2] [--clock cpu|wall]``
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch
import torch.nn.functional as F

from fedhet.algorithms import FedAvg
from fedhet.algorithms.shared.common import model_weights
from fedhet.data import DirichletPartitioner, LabelSkewScenario
from fedhet.federation import FederationLoop, FederationSettings
from fedhet.federation.trainer import TrainerTemplate, silence_lightning
from fedhet.functional import weighted_average
from fedhet.seeding import derive_seed

CLOCK = "cpu"


def now() -> float:
    """The clock both loops are timed with: wall time, or this process's CPU time (``--clock cpu``).

    CPU time is steadier on a shared machine (time the process waits for a core is not counted).
    """
    return time.process_time() if CLOCK == "cpu" else time.perf_counter()


def build_scenario(image_size: int, batch_size: int) -> LabelSkewScenario:
    """The benchmark's label-skew MNIST: 10 Dirichlet(0.1) clients of about 100 images (few steps per fit)."""
    scenario = LabelSkewScenario(
        dataset="mnist",
        num_clients=10,
        partitioner=DirichletPartitioner(beta=0.1, min_size=20),
        image_size=image_size,
        batch_size=batch_size,
        seed=0,
    )
    scenario.setup()
    return scenario


def run_fedhet(scenario: LabelSkewScenario, model: str, rounds: int, epochs: int, lr: float) -> tuple[float, dict]:
    """FedAvg through fedhet's round loop: (seconds on the benchmark's clock, final global weights)."""
    loop = FederationLoop(
        FedAvg(optimizer="sgd", lr=lr, momentum=0.9),
        scenario,
        [model] * scenario.num_clients,
        TrainerTemplate(max_epochs=epochs, accelerator="cpu"),
        rounds=rounds + 1,
        seed=0,
        settings=FederationSettings(eval_every=rounds + 2),
    )
    started = now()
    for round_idx in range(rounds):  # the loop is configured one round longer, so none of these evaluates
        loop.run_round(round_idx)
        loop.next_round = round_idx + 1
    return now() - started, loop.server.global_weights


def run_plain(scenario: LabelSkewScenario, model: str, rounds: int, epochs: int, lr: float) -> tuple[float, dict]:
    """The same FedAvg written by hand in plain PyTorch."""
    from fedhet.federation.runtime import ClientRuntime

    runtime = ClientRuntime(FedAvg(lr=lr), scenario, [model] * scenario.num_clients, TrainerTemplate(), seed=0)
    network = runtime.build_module(model, 0).model  # one live network, weights swapped in
    global_weights = model_weights(runtime.initial_state(0)["module"])
    optimizer_states: dict[int, dict] = {}
    started = now()
    for round_idx in range(rounds):
        states, sizes = [], []
        for client in range(scenario.num_clients):
            network.load_state_dict(global_weights)
            optimizer = torch.optim.SGD(network.parameters(), lr=lr, momentum=0.9)
            if client in optimizer_states:
                optimizer.load_state_dict(optimizer_states[client])
            seed = derive_seed(0, "fit", round_idx, client)
            torch.random.default_generator.manual_seed(seed)  # what fedhet seeds per fit
            network.train()
            loader = scenario.train_loader(client, seed)
            for _ in range(epochs):
                for x, y in loader:
                    loss = F.cross_entropy(network(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            optimizer_states[client] = copy.deepcopy(optimizer.state_dict())
            states.append({k: v.detach().clone() for k, v in network.state_dict().items()})
            sizes.append(len(scenario.client_data(client).train))
        global_weights = weighted_average(states, sizes)
    return now() - started, global_weights


def main() -> None:
    """Alternate the two loops --repeats times and print the medians and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5,
                        help="alternate the two loops this many times; report medians")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="resnet12_tiny")
    parser.add_argument("--image_size", type=int, default=28)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    args = parser.parse_args()
    global CLOCK
    CLOCK = args.clock
    torch.set_num_threads(args.threads)
    silence_lightning()
    logging.getLogger("fedhet").setLevel(logging.WARNING)
    scenario = build_scenario(args.image_size, args.batch_size)
    steps = sum(len(scenario.train_loader(c, 0)) for c in range(scenario.num_clients)) * args.epochs * args.rounds
    print(f"FedAvg, {scenario.num_clients} clients, model {args.model}, "
          f"{args.rounds} rounds x {args.epochs} local epochs, "
          f"{steps} local steps per run, batch {args.batch_size}, {args.image_size}px, {args.threads} threads, "
          f"{args.clock} clock")
    run_plain(scenario, args.model, 1, 1, args.lr)  # warm-up (allocator, kernels) for both paths
    run_fedhet(scenario, args.model, 1, 1, args.lr)
    fedhet_times, plain_times = [], []
    for repeat in range(args.repeats):
        fedhet_s, fedhet_weights = run_fedhet(scenario, args.model, args.rounds, args.epochs, args.lr)
        plain_s, plain_weights = run_plain(scenario, args.model, args.rounds, args.epochs, args.lr)
        fedhet_times.append(fedhet_s)
        plain_times.append(plain_s)
        difference = max(float((fedhet_weights[k].double() - plain_weights[k].double()).abs().max())
                         for k in plain_weights)
        print(f"repeat {repeat + 1}: fedhet {fedhet_s:.2f}s  plain {plain_s:.2f}s  "
              f"ratio {fedhet_s / plain_s:.3f}  max |w_fedhet - w_plain| = {difference:.2e}")
    fedhet_median = sorted(fedhet_times)[len(fedhet_times) // 2]
    plain_median = sorted(plain_times)[len(plain_times) // 2]
    print(f"median: fedhet {fedhet_median:.2f}s  plain {plain_median:.2f}s  "
          f"per step: fedhet {1e3 * fedhet_median / steps:.2f} ms  plain {1e3 * plain_median / steps:.2f} ms")
    print(f"best of {args.repeats}: fedhet {min(fedhet_times):.2f}s  plain {min(plain_times):.2f}s  "
          f"ratio {min(fedhet_times) / min(plain_times):.3f}")
    print(f"ratio {fedhet_median / plain_median:.3f}")


if __name__ == "__main__":
    main()
