"""What FedMD-CG's server distillation does to the shared classifier (diagnostic for fedmdcg_mnist).

One run of the ``fedmdcg_mnist`` cell (same scenario, budget and flags; the probe draws its
noise inside ``torch.random.fork_rng``, so the run's numbers are the benchmark cell's). After
every round it scores, on the 1,000 test digits and averaged over the 10 clients, each client's
extractor ``F_i`` (as uploaded this round) with (a) its own classifier ``D_i``, (b) the
example-weighted average ``D`` of the uploads (what ``AVE_agg`` downloads) and (c) the distilled
``D`` (what ``KDC_agg`` / ``KD_agg`` downloads); and the teachers' consistency, the
``tau``-weighted accuracy of ``D_i(G_i(z, y))`` on 512 labels drawn from ``p(y)`` (the "G+D"
diagnostic of the paper's Fig. 5, as an accuracy).

    python reproductions/fedmdcg_kd_probe.py [--aggregation kdc] [--seed 0] [--omega 0.1]
        [--rounds 10] [--local_steps 10] [--server_steps 20] [--persistent_server_adam]

Writes ``docs/results/fedmdcg_kd_probe.json`` (one entry per configuration, merged).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from fedmdcg_privacy import CODE_FLAGS, OUT, scenario  # noqa: E402  (this folder)

from fedhet.algorithms.fedmdcg import FedMDCG  # noqa: E402
from fedhet.algorithms.shared.generators import GeneratorClassifierServer  # noqa: E402
from fedhet.core.state import clone_state, copy_state_into  # noqa: E402
from fedhet.federation import FederationLoop, FederationSettings  # noqa: E402
from fedhet.federation.trainer import TrainerTemplate  # noqa: E402


class ProbedServer(GeneratorClassifierServer):
    """Keeps the averaged classifier of the round and scores the teachers' consistency."""

    persistent_adam = False

    def aggregate(self, round_idx: int, uploads: Any) -> None:
        super().aggregate(round_idx, uploads)
        self.averaged = clone_state(self.classifier.state_dict())
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(0)
            labels = torch.multinomial(self.round_counts, 512, True)
            tau = self.round_tau[:, labels]
            hits = torch.zeros(512)
            for i, (generator, classifier) in enumerate(self.teachers):
                features, _ = generator(labels)
                hits += tau[i] * (classifier(features).argmax(1) == labels).float()
        self.teacher_accuracy = round(100 * float(hits.mean()), 1) if self.teachers else None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizers()
        if self.persistent_adam and getattr(self, "saved_adam", None) is not None:
            optimizer.load_state_dict(self.saved_adam)  # the code's once-created server Adam
        self.live_optimizer = optimizer
        return optimizer

    def on_train_end(self) -> None:
        self.saved_adam = copy.deepcopy(self.live_optimizer.state_dict())


class Probe:
    """Round callback: the three classifiers on every client's extractor."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_round_end(self, loop: FederationLoop, record: dict[str, Any]) -> None:
        with torch.random.fork_rng():
            server = loop.server
            sets = loop.runtime.eval_sets(None)[:1]
            scores: dict[str, list[float]] = {"own": [], "averaged": [], "distilled": []}
            heads = {"own": None, "averaged": server.averaged, "distilled": server.classifier.state_dict()}
            for cid in range(len(loop.architectures)):
                state = loop.store.get(cid)["module"]
                network = loop.runtime.build_network(loop.architectures[cid], loop.seed)
                copy_state_into(network, {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
                for name, head in heads.items():
                    if head is not None:
                        copy_state_into(network.head, head)
                    ((correct, total),) = loop.runtime.evaluate_model(network, sets)
                    scores[name].append(100 * float(correct[0] / total[0]))
            row = {
                "round": record.get("round"),
                "acc_local": record.get("acc_local"),
                "acc_server": record.get("acc_server"),
                "teacher_accuracy": server.teacher_accuracy,
                **{f"extractors_with_{k}_classifier": round(sum(v) / len(v), 2) for k, v in scores.items()},
                "distill_loss_first": record.get("server/distill_loss_first"),
                "distill_loss_last": record.get("server/distill_loss"),
            }
            self.rows.append(row)
            print(row, flush=True)

    def on_run_end(self, loop: FederationLoop, summary: dict[str, Any]) -> None:
        pass


def main() -> None:
    """Run the probed cell and merge its rows into the probe's JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--aggregation", default="kdc", choices=["kdc", "kd"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--omega", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local_steps", type=int, default=10)
    parser.add_argument("--server_steps", type=int, default=20)
    parser.add_argument("--persistent_server_adam", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    class Probed(FedMDCG):
        def build_server(self) -> ProbedServer:
            server = ProbedServer(self.make_generator, self.hp)
            server.persistent_adam = args.persistent_server_adam
            return server

    Probed.__name__ = Probed.__qualname__ = "FedMDCG"
    algorithm = Probed(
        aggregation=args.aggregation, local_steps=args.local_steps, server_steps=args.server_steps,
        optimizer="sgd", lr=0.05, weight_decay=1e-4, **CODE_FLAGS,
    )  # fmt: skip
    probe = Probe()
    loop = FederationLoop(
        algorithm, scenario(args.seed, args.omega), ["lenet5"] * 10, TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=args.rounds, seed=args.seed, settings=FederationSettings(eval_every=1), callbacks=[probe],
    )  # fmt: skip
    started = time.perf_counter()
    loop.run()
    key = (
        f"{args.aggregation} seed={args.seed} omega={args.omega} rounds={args.rounds} local_steps={args.local_steps} "
        f"server_steps={args.server_steps}" + (" persistent_server_adam" if args.persistent_server_adam else "")
    )
    path = OUT / "fedmdcg_kd_probe.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = {"rows": probe.rows, "wall_s": round(time.perf_counter() - started, 1)}
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path} [{key}]", flush=True)


if __name__ == "__main__":
    main()
