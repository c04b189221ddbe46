"""FedVTC at its shipped budget: the acceptance check of ``configs/experiments/mnist_vtc/fedvtc.yaml``.

``fedvtc_mnist.py`` compares every method at a scaled-down budget (T = 5 rounds of E = 1 epoch).
This script runs the configs as shipped (T = 20 rounds of the paper's E = 5 epochs, then FedVTC's
psi upload and 5 fine-tuning rounds of 5 epochs, or the baselines' 5 extra full-participation
rounds) and asks the issue's two questions of each seed: is FedVTC's generalization accuracy after
fine-tuning above FedProto's and FedTGP's, and does accuracy jump when fine-tuning starts? The same
questions are asked at the other budgets of :data:`BUDGETS` (fewer rounds; E = 1 and 2, the
budget the configs shipped before), where FedVTC's variants ran too (L_e, L_dm kept out of the
extractor's step, anchor-scaled prototypes, psi once, a smaller fine-tuning rate). For every
FedVTC run, two diagnostics of its synthetic set: the share of decoded digits a held-out model
recognises (``fedvtc_mnist.synthetic_images``) and the geometry of the final global prototypes.

Writes ``docs/results/fedvtc_config.{md,json,png}`` and ``fedvtc_config_images.png`` (the shipped
seed-0 digits). Run: ``python benchmarks/fedvtc_config.py --seeds 0 1 2 --jobs 2 --only
t20e5/fedvtc t20e5/fedproto t20e5/fedtgp`` (about 20 CPU-minutes per FedVTC run and 10 per
baseline run at the shipped budget, one thread each); without ``--only`` every row of every budget runs;
``--report-only`` rewrites the page. A run directory may hold a ``provenance.json``
(``{"machine": ...}``) when it ran elsewhere; the page names the machine of every cell.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from comparison import REPO, Run, execute, load, mean_std, write_atomic
from fedvtc_mnist import THIS_MACHINE, machine_of, synthetic_images

from fedhet.bench import curves_png

CONFIGS = REPO / "configs" / "experiments" / "mnist_vtc"
SHIPPED = "t20e5"
#: Budgets: name -> (flags of every run, FedVTC's extra flags, what it is). The shipped budget runs the configs as
#: they are; the others pin rounds and epochs, so their runs stay what they were when the configs change.
BUDGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "t20e5": ((), (), "as shipped: T = 20 rounds of E = 5 epochs, 5 fine-tuning rounds of 5 epochs; each client's "
                      "schedule in the paper (T = 100 at 10% participation is 10 visits of E = 5 epochs)"),
    "t5e5": (("--rounds", "5", "--trainer.max_epochs=5"), ("--method.init_args.finetune_epochs=5",),
             "T = 5 rounds of E = 5 epochs, 5 fine-tuning rounds of 5 epochs (a few CPU minutes)"),
    "t10e5": (("--rounds", "10", "--trainer.max_epochs=5"), ("--method.init_args.finetune_epochs=5",),
              "T = 10 rounds of E = 5 epochs, 5 fine-tuning rounds of 5 epochs"),
    "t20e1": (("--rounds", "20", "--trainer.max_epochs=1"), ("--method.init_args.finetune_epochs=1",),
              "T = 20 rounds of E = 1 epoch, 5 fine-tuning rounds of 1 epoch (the spec's CPU variant; shipped until "
              "2026-11-26)"),
    "t20e2": (("--rounds", "20", "--trainer.max_epochs=2"), ("--method.init_args.finetune_epochs=2",),
              "T = 20 rounds of E = 2 epochs, 5 fine-tuning rounds of 2 epochs"),
}
#: Rows within a budget: name -> (config, flags, what it is).
VARIANTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "fedvtc": ("fedvtc", (), "FedVTC (L_tc, psi every round)"),
    "fedproto": ("fedproto", (), "FedProto"),
    "fedtgp": ("fedtgp", (), "FedTGP"),
    "ccvr": ("ccvr", (), "CCVR"),
    "fedtype": ("fedtype", (), "FedType"),
    "fedgen": ("fedgen", (), "FedGen"),
    "fedvtc_e": ("fedvtc_e", (), "FedVTC, L_e only (lambda = 0, Table 4)"),
    "fedvtc_dm_vtc_only": ("fedvtc", ("--method.init_args.dm_trains_extractor=false",),
                           "FedVTC, L_dm in the VTC's step only (not the extractor's)"),
    "fedvtc_dm_vtc_only_ftlr": ("fedvtc", ("--method.init_args.dm_trains_extractor=false",
                                           "--method.init_args.finetune_lr=0.005"),
                                "FedVTC, L_dm in the VTC's step only, fine-tuning at lr 0.005"),
    "fedvtc_anchor_scale": ("fedvtc", ("--method.init_args.prototype_scale=anchors",),
                            "FedVTC, prototypes rescaled to the anchors' norm each round"),
    "fedvtc_anchor_scale_ftlr": ("fedvtc", ("--method.init_args.prototype_scale=anchors",
                                            "--method.init_args.finetune_lr=0.005"),
                                 "FedVTC, prototypes rescaled to the anchors' norm, fine-tuning at lr 0.005"),
    "fedvtc_psi_once": ("fedvtc", ("--method.init_args.psi_sync=once",), "FedVTC, psi once (Table 3 1)"),
    "fedvtc_ftlr": ("fedvtc", ("--method.init_args.finetune_lr=0.005",), "FedVTC, fine-tuning at lr 0.005"),
    "fedvtc_e_ftlr": ("fedvtc_e", ("--method.init_args.finetune_lr=0.005",), "FedVTC L_e, fine-tuning at lr 0.005"),
    "fedvtc_e_ftfrozen": ("fedvtc_e", ("--method.init_args.finetune_bn=frozen",),
                          "FedVTC L_e, classifiers' BatchNorm frozen while fine-tuning"),
}
#: The rows measured at each budget (``budget/variant`` is a row's label and its runs' folder).
MEASURED = {
    "t20e5": ("fedvtc", "fedproto", "fedtgp", "ccvr", "fedtype", "fedgen", "fedvtc_e"),
    "t5e5": ("fedvtc", "fedproto", "fedtgp"),
    "t10e5": ("fedvtc",),
    "t20e1": tuple(v for v in VARIANTS if v not in ("ccvr", "fedtype", "fedgen")),
    "t20e2": ("fedvtc", "fedproto", "fedtgp"),
}
ROWS: dict[str, tuple[str, tuple[str, ...], str]] = {  # label: (config, flags, what it is)
    f"{budget}/{variant}": (VARIANTS[variant][0],
                            BUDGETS[budget][0] + (BUDGETS[budget][1] if variant.startswith("fedvtc") else ())
                            + VARIANTS[variant][1], VARIANTS[variant][2])
    for budget, variants in MEASURED.items() for variant in variants
}
BASELINES = ("fedproto", "fedtgp")


def variant_of(label: str) -> str:
    """``t5e5/fedvtc`` -> ``fedvtc``."""
    return label.split("/", 1)[1]


def budget_of(label: str) -> str:
    """``t5e5/fedvtc`` -> ``t5e5``."""
    return label.split("/", 1)[0]
FLAGS = ("--federation.eval_every=1",)
OUT = REPO / "docs" / "results"
ROOT = REPO / "runs" / "fedvtc_config"
#: Synthetic digits scored per class (500 in all: one digit moves the score by 0.2 points).
SCORED_PER_CLASS = 50


def plan(seeds: list[int], only: list[str] | None) -> list[Run]:
    """Every row (or the ``only`` ones) at every seed, with every round evaluated."""
    return [Run(label, str(CONFIGS / f"{config}.yaml"), seed, FLAGS + flags)
            for label, (config, flags, _) in ROWS.items() if not only or label in only for seed in seeds]


def diagnostics(label: str, seed: int, root: Path) -> dict[str, Any]:
    """Held-out recognition of the run's synthetic digits and its final prototypes' geometry (cached in the run)."""
    cached = root / label / f"seed{seed}" / f"recognition_{SCORED_PER_CLASS}.json"
    if cached.is_file():
        record = json.loads(cached.read_text())
    else:
        record = synthetic_images(root, seed, label, grid=None, per_class=SCORED_PER_CLASS)
        if record is None:
            return {}
        write_atomic(cached, json.dumps(record, indent=1))
    return {"recognised": record["recognised_percent"],
            **{key: record[key] for key in ("prototype_norm", "prototype_min_distance", "sigma_norm")}}


def collect(runs: list[Run], root: Path) -> dict[str, list[dict[str, Any]]]:
    """Per row, one record per complete run: accuracy after round T, at the first fine-tuning round, at the end."""
    results: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        run_dir = run.run_dir(root)
        if not (run_dir / "summary.json").is_file():
            continue
        history = load(run, root)["history"]
        evaluated = [r for r in history if "acc_global" in r]
        federated = [r for r in evaluated if "phase" not in r]
        finetune = [r for r in evaluated if r.get("phase") == "finetune"]
        row = {
            "seed": run.seed,
            "after_rounds": federated[-1]["acc_global"],
            "first_finetune": finetune[0]["acc_global"] if finetune else None,
            "final": evaluated[-1]["acc_global"],
            "curve": [r["acc_global"] for r in evaluated if r.get("phase") != "vtc_sync"],  # aligned with extra rounds
            "machine": machine_of(run_dir),
        }
        if variant_of(run.label).startswith("fedvtc"):
            row.update(diagnostics(run.label, run.seed, root))
        results.setdefault(run.label, []).append(row)
    return results


def _mean(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "-"
    mean, std = mean_std(values)
    return f"{mean:.2f} ± {std:.2f}" if len(values) > 1 else f"{mean:.2f}"


def baseline_finals(results: dict[str, list[dict[str, Any]]], budget: str) -> dict[str, dict[int, float]]:
    """Per baseline, its final accuracy per seed at ``budget``."""
    return {b: {r["seed"]: r["final"] for r in results.get(f"{budget}/{b}", [])} for b in BASELINES}


def acceptance(results: dict[str, list[dict[str, Any]]], label: str) -> list[str]:
    """Per seed: above both baselines after fine-tuning? a jump at the first fine-tuning round? a rise by the end?"""
    lines = ["| seed | FedVTC after round T | first fine-tuning round | after fine-tuning | FedProto | FedTGP | "
             "above both | jumps at fine-tuning start | rises over fine-tuning |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = baseline_finals(results, budget_of(label))
    for row in results.get(label, []):
        seed = row["seed"]
        others = [base[b].get(seed) for b in BASELINES]
        above = "not run" if None in others else ("yes" if row["final"] > max(others) else "no")
        jump = row["first_finetune"] - row["after_rounds"]
        rise = row["final"] - row["after_rounds"]
        cells = [f"{v:.2f}" if v is not None else "not run" for v in others]
        lines.append(f"| {seed} | {row['after_rounds']:.2f} | {row['first_finetune']:.2f} | {row['final']:.2f} | "
                     f"{' | '.join(cells)} | {above} | {'yes' if jump > 0 else 'no'} ({jump:+.2f}) | "
                     f"{'yes' if rise > 0 else 'no'} ({rise:+.2f}) |")
    return lines


def verdicts(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The issue's two checks over the seeds: every FedVTC row against the better baseline of its budget."""
    lines = []
    for label, rows in results.items():
        if not variant_of(label).startswith("fedvtc"):
            continue
        base = baseline_finals(results, budget_of(label))
        paired = [r for r in rows if all(r["seed"] in base[b] for b in BASELINES)]
        above = sum(r["final"] > max(base[b][r["seed"]] for b in BASELINES) for r in paired)
        jumps = sum(r["first_finetune"] is not None and r["first_finetune"] > r["after_rounds"] for r in rows)
        rises = sum(r["final"] > r["after_rounds"] for r in rows)
        lines.append(f"- `{budget_of(label)}` {ROWS[label][2]}: above FedProto and FedTGP at {above} of {len(paired)} "
                     f"seeds; jumps at the first fine-tuning round at {jumps} of {len(rows)}; ends above its round-T "
                     f"accuracy at {rises} of {len(rows)} (final {_mean(rows, 'final')}).")
    return lines


def write_page(results: dict[str, list[dict[str, Any]]], seeds: list[int]) -> None:
    """``docs/results/fedvtc_config.md``: the per-seed acceptance per budget, the verdicts, every row and every run."""
    lines = [
        "# FedVTC in the `mnist_vtc` configs: the acceptance check, and how it depends on the schedule",
        "",
        "Generated by `python benchmarks/fedvtc_config.py --seeds " + " ".join(map(str, seeds)) + "` from the configs "
        "in `configs/experiments/mnist_vtc/` (seed overridden; every round evaluated): all 5,000 embedded MNIST "
        "digits, 10 clients of five heterogeneous small models, Dir(0.1), 5 clients per round, batch 16, SGD 0.05 / "
        "momentum 0.9, gradients clipped to norm 5; after the T rounds, FedVTC's psi upload and 5 fine-tuning rounds "
        "over its 500 synthetic digits, or the baselines' 5 extra full-participation rounds. **Metric**: "
        "generalization accuracy, every client's own model on the 1,000 held-out global test digits, averaged over "
        "clients (`acc_global`), %. **Budgets** (a row's label starts with its budget):",
        "",
        *[f"- `{name}`: {what}" for name, (_, _, what) in BUDGETS.items()],
        "",
        f"## Acceptance, per seed: FedVTC as shipped (`{SHIPPED}`) against FedProto and FedTGP",
        "",
        *acceptance(results, f"{SHIPPED}/fedvtc"),
        "",
    ]
    for budget in BUDGETS:
        if budget != SHIPPED and results.get(f"{budget}/fedvtc"):
            lines += [f"## The same check at `{budget}`", "", *acceptance(results, f"{budget}/fedvtc"), ""]
    lines += [
        "## Verdicts",
        "",
        *verdicts(results),
        "",
        "## Every row",
        "",
        "| row | n | after round T | first fine-tuning round / extra round | final | recognised synthetic digits | "
        "prototype norm | smallest prototype distance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, (_, _, what) in ROWS.items():
        rows = results.get(label, [])
        if not rows:
            lines.append(f"| `{budget_of(label)}` {what} | 0 | not run | | | | | |")
            continue
        first = [{**r, "first": r["first_finetune"] if r["first_finetune"] is not None else r["curve"][-5]}
                 for r in rows]
        lines.append(f"| `{budget_of(label)}` {what} | {len(rows)} (seeds {','.join(str(r['seed']) for r in rows)}) | "
                     f"{_mean(rows, 'after_rounds')} | {_mean(first, 'first')} | **{_mean(rows, 'final')}** | "
                     f"{_mean(rows, 'recognised')} | {_mean(rows, 'prototype_norm')} | "
                     f"{_mean(rows, 'prototype_min_distance')} |")
    lines += [
        "",
        "Recognised: a held-out simple_cnn trained only on the global test digits classifies "
        f"{SCORED_PER_CLASS} digits per class decoded from the final global psi, prototypes and sigma "
        "(chance 10%). Prototype norm: the mean norm of the final global prototypes; the seeded anchors "
        "they start from have norm 3.1 (0.1 x sqrt(980)), and the sampling noise `sigma * eps` has norm "
        "about 3.1 (sigma stays at 0.1).",
        "",
        "![FedVTC's synthetic digits, as shipped, seed 0](fedvtc_config_images.png)",
        "",
        "## Per run",
        "",
        "| row | seed | after round T | final | recognised | prototype norm | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in results.items():
        for r in sorted(rows, key=lambda r: r["seed"]):
            recognised = f"{r['recognised']:.0f}%" if "recognised" in r else "-"
            norm = f"{r['prototype_norm']:.1f}" if "prototype_norm" in r else "-"
            lines.append(f"| {label} | {r['seed']} | {r['after_rounds']:.2f} | {r['final']:.2f} | {recognised} | "
                         f"{norm} | {r['machine']} |")
    lines += ["", "![acc_global across the rounds and the fine-tuning: the old budget, a few-minute budget and the "
              "shipped one](fedvtc_config.png)", ""]
    write_atomic(OUT / "fedvtc_config.md", "\n".join(lines))


#: The rows drawn in the curves, and the budgets that get a panel (the shipped one last: it carries the legend).
CURVES = ("fedvtc", "fedvtc_e", *BASELINES)
PANELS = ("t20e1", "t5e5", SHIPPED)


def main() -> None:
    """Run the missing runs, then write the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="*", default=None, help="row labels to run (budget/variant)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--report-only", action="store_true", help="write the page from the runs already complete")
    args = parser.parse_args()
    if not args.report_only:
        execute(plan(args.seeds, args.only), args.root, args.jobs)
    results = collect(plan(args.seeds, None), args.root)
    series = {VARIANTS[variant][2]: [[r["curve"] if budget_of(label) == budget else [] for budget in PANELS]
                                     for label in (f"{b}/{variant}" for b in PANELS) for r in results.get(label, [])]
              for variant in CURVES}
    curves_png(OUT / "fedvtc_config.png", series,
               [f"{b}: acc_global over the rounds, then fine-tuning / extra rounds" for b in PANELS],
               highlight=lambda name: name.startswith("FedVTC"))
    synthetic_images(args.root, 0, f"{SHIPPED}/fedvtc", grid=OUT / "fedvtc_config_images.png")
    write_atomic(OUT / "fedvtc_config.json", json.dumps({"machine_here": THIS_MACHINE, "budgets": BUDGETS,
                                                         "results": results}, indent=1, sort_keys=True))
    write_page(results, args.seeds)


if __name__ == "__main__":
    main()
