"""What FedMD-CG's server distillation does to the shared classifier (diagnostic for fedmdcg_mnist).

One run of the ``fedmdcg_mnist`` cell: the shipped ``configs/experiments/mnist_mdcg/fedmdcg.yaml``
(its scenario, model and method flags, read through :mod:`fedhet.config`) with the probe's
budget on top (``--rounds``, ``--local_steps``, ``--server_steps``, ``--omega``, ``--aggregation``,
``--seed``); the probe draws its noise inside ``torch.random.fork_rng``, so the run's numbers are
the cell's. After
every round it scores, on the 1,000 test digits and averaged over the 10 clients, each client's
extractor ``F_i`` (as uploaded this round) with (a) its own classifier ``D_i``, (b) the
example-weighted average ``D`` of the uploads (what ``AVE_agg`` downloads) and (c) the distilled
``D`` (what ``KDC_agg`` / ``KD_agg`` downloads); and the teachers' consistency, the
``tau``-weighted accuracy of ``D_i(G_i(z, y))`` on 512 labels drawn from ``p(y)`` (the "G+D"
diagnostic of the paper's Fig. 5, as an accuracy).

    python reproductions/fedmdcg_kd_probe.py [--aggregation kdc] [--seed 0] [--omega 0.1]
        [--rounds 10] [--local_steps 10] [--server_steps 20] [--persistent_server_adam]
    python reproductions/fedmdcg_kd_probe.py --report_only

Writes ``docs/results/fedmdcg_kd_probe.json`` (one entry per configuration, merged) and renders its
tables into the diagnostic section of ``docs/fedmdcg.md`` (between the ``kd-probe`` markers);
``--report_only`` rewrites that section from the json alone. Not a results page: a probe inside one
run, with a server that keeps extra state, is not a ``fedhet fit`` cell of a grid.
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

from fedhet.algorithms.shared.generators import GeneratorClassifierServer  # noqa: E402
from fedhet.config import build_experiment, parse_args  # noqa: E402
from fedhet.core.state import clone_state, copy_state_into  # noqa: E402
from fedhet.federation import FederationLoop, MemoryStateStore  # noqa: E402
from fedhet.files import atomic_write_text  # noqa: E402

OUT = Path(os.environ.get("FEDMDCG_BENCH_OUT", REPO / "docs" / "results"))
#: the probe's json, and the document whose diagnostic section renders it
PROBE_JSON = OUT / "fedmdcg_kd_probe.json"
DOC = REPO / "docs" / "fedmdcg.md"
BEGIN, END = "<!-- kd-probe:begin (written by reproductions/fedmdcg_kd_probe.py) -->", "<!-- kd-probe:end -->"

#: the probed cell: everything but the probe's budget comes from here
CONFIG = REPO / "configs" / "experiments" / "mnist_mdcg" / "fedmdcg.yaml"


def probe_section(probes: dict[str, Any]) -> str:
    """The probe's tables, one per recorded configuration (the text between the markers of docs/fedmdcg.md)."""
    lines: list[str] = []
    for key, probe in probes.items():
        lines += [
            f"**{key}** ({probe['wall_s']:.0f} s)",
            "",
            "| round | L.acc | G.acc | teachers | F_i + own D_i | F_i + averaged D | F_i + distilled D "
            "| KD loss first / last |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in probe["rows"]:
            lines.append(
                f"| {row['round']} | {row['acc_local']:.1f} | {row['acc_server']:.1f} | {row['teacher_accuracy']} | "
                f"{row['extractors_with_own_classifier']:.1f} | {row['extractors_with_averaged_classifier']:.1f} | "
                f"{row['extractors_with_distilled_classifier']:.1f} | "
                f"{row['distill_loss_first']:.2e} / {row['distill_loss_last']:.2e} |"
            )
        rows = probe["rows"][1:]
        worse = sum(r["extractors_with_distilled_classifier"] < r["extractors_with_averaged_classifier"] for r in rows)
        summary = f"The distilled D is below the averaged D in {worse} of the {len(rows)} rounds after round 0."
        lines += ["", summary, ""]
    return "\n".join(lines).rstrip()


def document_with_section(text: str, probes: dict[str, Any]) -> str:
    """``text`` (docs/fedmdcg.md) with the probe's tables between its markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{DOC}: no '{BEGIN}' ... '{END}' markers; put them where the probe's tables go")
    return text[: start + len(BEGIN)] + "\n" + probe_section(probes) + "\n" + text[end:]


def write_section() -> None:
    """Rewrite the probe's section of docs/fedmdcg.md from its json."""
    atomic_write_text(DOC, document_with_section(DOC.read_text(), json.loads(PROBE_JSON.read_text())))
    print(f"wrote the probe's tables into {DOC}", flush=True)


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
    parser.add_argument("--report_only", action="store_true", help="rewrite docs/fedmdcg.md's section from the json")
    args = parser.parse_args()
    if args.report_only:
        write_section()
        return
    torch.set_num_threads(1)
    parser, config = parse_args(
        [
            "--config", str(CONFIG), "--seed", str(args.seed), "--rounds", str(args.rounds), "--threads", "1",
            "--scenario.partitioner.init_args.omega", str(args.omega),
            "--method.init_args.aggregation", args.aggregation,
            "--method.init_args.local_steps", str(args.local_steps),
            "--method.init_args.server_steps", str(args.server_steps),
            "--federation.eval_every", "1", "--trainer.accelerator", "cpu", "--wandb.mode", "disabled",
        ]
    )  # fmt: skip
    experiment = build_experiment(parser, config, logging_run=False)
    algorithm = experiment.method

    def probed_server() -> ProbedServer:  # the config's FedMD-CG, with the probing server
        server = ProbedServer(algorithm.make_generator, algorithm.hp)
        server.persistent_adam = args.persistent_server_adam
        return server

    algorithm.build_server = probed_server
    probe = Probe()
    loop = experiment.build_loop(MemoryStateStore())
    loop.callbacks.append(probe)
    started = time.perf_counter()
    loop.run()
    key = (
        f"{args.aggregation} seed={args.seed} omega={args.omega} rounds={args.rounds} local_steps={args.local_steps} "
        f"server_steps={args.server_steps}" + (" persistent_server_adam" if args.persistent_server_adam else "")
    )
    path = PROBE_JSON
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = {"rows": probe.rows, "wall_s": round(time.perf_counter() - started, 1)}
    atomic_write_text(path, json.dumps(results, indent=1))
    print(f"wrote {path} [{key}]", flush=True)
    write_section()


if __name__ == "__main__":
    main()
