"""FedVTC at its shipped budget: the acceptance check of ``configs/experiments/mnist_vtc/fedvtc.yaml``.

The configs ship T = 10 rounds of the paper's E = 5 epochs (then FedVTC's psi upload and 5
fine-tuning rounds of 5 epochs, or the baselines' 5 extra full-participation rounds): a few CPU
minutes. This script runs them as shipped and asks the issue's two questions of each seed: is
FedVTC's generalization accuracy after fine-tuning above FedProto's and FedTGP's, and does accuracy
jump when fine-tuning starts? The same questions are asked at the other budgets of
:data:`BUDGETS`: T = 20 rounds of E = 5 (each client's schedule in the paper, the schedule of
``fedvtc_mnist.py``'s Table 1), T = 5, and E = 1 and 2 (the budgets the configs shipped before),
where FedVTC's variants ran too (L_e, L_dm kept out of the extractor's step, anchor-scaled
prototypes, psi once, a smaller fine-tuning rate). The page says where FedVTC is above the
baselines, where not, and why. For every FedVTC run, two diagnostics of its synthetic set: the share of
decoded digits a held-out model recognises (``fedvtc_mnist.synthetic_images``) and the geometry of
the final global prototypes.

Writes ``docs/results/fedvtc_config.{md,json,png}`` and ``fedvtc_config_images.png`` (the shipped
seed-0 digits). Run: ``python reproductions/fedvtc_config.py --seeds 0 1 2 --only t10e5/fedvtc
t10e5/fedproto t10e5/fedtgp`` (about 5 minutes per FedVTC run and 2-3 per baseline run at the
shipped budget, every round evaluated; 8-10 and 3-4 at T = 20); without ``--only`` every row of every budget runs;
``--report-only`` rewrites the page from the runs under ``--root``, and ``--reuse
docs/results/fedvtc_config.json`` adds the page's earlier records of the runs not there (the json
holds every run's numbers and curve). A run directory may hold a ``provenance.json``
(``{"machine": ...}``) when it ran elsewhere; the page names the machine of every cell.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from comparison import REPO, Run, execute, load, mean_std, reuse_archived, write_atomic
from fedvtc_mnist import THIS_MACHINE, machine_of, synthetic_images

from fedhet.bench import curves_png

CONFIGS = REPO / "configs" / "experiments" / "mnist_vtc"
SHIPPED = "t10e5"
#: Budgets: name -> (flags of every run, FedVTC's extra flags, what it is). The shipped budget runs the configs as
#: they are; the others pin rounds and epochs, so their runs stay what they were when the configs change.
BUDGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "t5e5": (("--rounds", "5", "--trainer.max_epochs=5"), ("--method.init_args.finetune_epochs=5",),
             "T = 5 rounds of E = 5 epochs, 5 fine-tuning rounds of 5 epochs (about 3 minutes for FedVTC)"),
    "t10e5": ((), (), "as shipped: T = 10 rounds of E = 5 epochs, 5 fine-tuning rounds of 5 epochs (about 4.5 "
                      "minutes for FedVTC on 2 CPU cores)"),
    "t20e5": (("--rounds", "20", "--trainer.max_epochs=5"), ("--method.init_args.finetune_epochs=5",),
              "T = 20 rounds of E = 5 epochs, 5 fine-tuning rounds of 5 epochs (8-10 minutes for FedVTC): each "
              "client's schedule in the paper (T = 100 at 10% participation is 10 visits of E = 5 epochs); the "
              "schedule of fedvtc_mnist.md, shipped 2026-11-26 to 2026-11-27"),
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
    "t5e5": ("fedvtc", "fedproto", "fedtgp", "ccvr", "fedtype", "fedgen", "fedvtc_e"),
    "t10e5": ("fedvtc", "fedproto", "fedtgp", "ccvr", "fedtype", "fedgen", "fedvtc_e"),
    "t20e5": ("fedvtc", "fedproto", "fedtgp", "ccvr", "fedtype", "fedgen", "fedvtc_e"),
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
    base, checks = baseline_finals(results, budget_of(label)), tally(results, label)
    for row in results.get(label, []):
        seed = row["seed"]
        others = [base[b].get(seed) for b in BASELINES]
        above = "yes" if seed in checks["above"] else "no" if seed in checks["below"] else "not run"
        jump = row["first_finetune"] - row["after_rounds"]
        rise = row["final"] - row["after_rounds"]
        cells = [f"{v:.2f}" if v is not None else "not run" for v in others]
        lines.append(f"| {seed} | {row['after_rounds']:.2f} | {row['first_finetune']:.2f} | {row['final']:.2f} | "
                     f"{' | '.join(cells)} | {above} | {'yes' if jump > 0 else 'no'} ({jump:+.2f}) | "
                     f"{'yes' if rise > 0 else 'no'} ({rise:+.2f}) |")
    return lines


def tally(results: dict[str, list[dict[str, Any]]], label: str) -> dict[str, Any]:
    """A FedVTC row's two checks over its seeds: above both baselines (seeds paired with them), jumps, rises."""
    rows = results.get(label, [])
    base = baseline_finals(results, budget_of(label))
    paired = [r for r in rows if all(r["seed"] in base[b] for b in BASELINES)]
    above = [r["seed"] for r in paired if r["final"] > max(base[b][r["seed"]] for b in BASELINES)]
    jumps = sum(r["first_finetune"] is not None and r["first_finetune"] > r["after_rounds"] for r in rows)
    rises = sum(r["final"] > r["after_rounds"] for r in rows)
    below = [r["seed"] for r in paired if r["seed"] not in above]
    return {"rows": rows, "paired": len(paired), "above": above, "below": below, "jumps": jumps, "rises": rises}


def verdicts(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The issue's two checks over the seeds: every FedVTC row against the better baseline of its budget."""
    lines = []
    for label in results:
        if not variant_of(label).startswith("fedvtc"):
            continue
        t = tally(results, label)
        n = len(t["rows"])
        lines.append(f"- `{budget_of(label)}` {ROWS[label][2]}: above FedProto and FedTGP at {len(t['above'])} of "
                     f"{t['paired']} seeds; jumps at the first fine-tuning round at {t['jumps']} of {n}; ends above "
                     f"its round-T accuracy at {t['rises']} of {n} (final {_mean(t['rows'], 'final')}).")
    return lines


#: Each client's schedule in the paper (T = 100 at 10% participation is 10 visits of E = 5 epochs).
PAPER_SCHEDULE = "t20e5"
#: The share of recognised synthetic digits that splits the FedVTC runs in "where and why not".
LEGIBLE_PERCENT = 40.0


#: Every Table 1 baseline of the page, for the strongest-fair-baseline check.
TABLE1_BASELINES = (*BASELINES, "ccvr", "fedtype", "fedgen")


def against_every_baseline(results: dict[str, list[dict[str, Any]]], fedvtc_rows: list[dict[str, Any]]) -> list[str]:
    """FedVTC as shipped against each Table 1 baseline at the seeds both ran, strongest baseline first."""
    vtc = {r["seed"]: r["final"] for r in fedvtc_rows}
    cells = []
    for baseline in TABLE1_BASELINES:
        rows = results.get(f"{SHIPPED}/{baseline}", [])
        shared = [r for r in rows if r["seed"] in vtc]
        if shared:
            wins = sum(vtc[r["seed"]] > r["final"] for r in shared)
            text = f"{VARIANTS[baseline][2]} {_mean(rows, 'final')} (FedVTC above it at {wins} of {len(shared)} "
            text += "shared seeds)"
            cells.append((mean_std([r["final"] for r in rows])[0], text))
    if not cells:
        return []
    cells.sort(key=lambda cell: -cell[0])
    return [f"Every Table 1 baseline at the shipped budget, strongest first: {'; '.join(c for _, c in cells)}.", ""]


def where_and_why_not(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Where FedVTC as shipped is above the baselines and where not, and the measured reason (its synthetic digits)."""
    shipped, paper = tally(results, f"{SHIPPED}/fedvtc"), tally(results, f"{PAPER_SCHEDULE}/fedvtc")
    if not shipped["rows"]:
        return []

    def finals(budget: str, variant: str) -> str:
        return _mean(results.get(f"{budget}/{variant}", []), "final")

    def seeds(values: list[int]) -> str:
        return f"seed{'s' if len(values) > 1 else ''} {', '.join(map(str, values))}"

    runs = [r for label, rows in results.items() if variant_of(label).startswith("fedvtc") for r in rows
            if "recognised" in r and r["first_finetune"] is not None]
    legible = [r for r in runs if r["recognised"] >= LEGIBLE_PERCENT]
    illegible = [r for r in runs if r["recognised"] < LEGIBLE_PERCENT]

    def jumped(group: list[dict[str, Any]]) -> str:
        return f"{sum(r['first_finetune'] > r['after_rounds'] for r in group)} of {len(group)}"

    above = f" ({seeds(shipped['above'])})" if shipped["above"] else ""
    below = f" It is not above both at {seeds(shipped['below'])}." if shipped["below"] else ""
    lines = [
        "## Where FedVTC is above the baselines, where not, and why",
        "",
        f"At the shipped budget (`{SHIPPED}`) FedVTC ends above FedProto and FedTGP at {len(shipped['above'])} of "
        f"{shipped['paired']} seeds{above}, and its accuracy jumps at the first fine-tuning round at "
        f"{shipped['jumps']} of {len(shipped['rows'])}: final {finals(SHIPPED, 'fedvtc')} against FedProto's "
        f"{finals(SHIPPED, 'fedproto')} and FedTGP's {finals(SHIPPED, 'fedtgp')}.{below}",
        "",
        *against_every_baseline(results, shipped["rows"]),
        "What decides it is the synthetic set, which is only as good as the federated VTC that decodes it: a "
        f"held-out classifier recognises {_mean(shipped['rows'], 'recognised')}% of the shipped budget's final "
        "synthetic digits (chance 10%). Across every FedVTC run on this page, those whose digits were under "
        f"{LEGIBLE_PERCENT:.0f}% recognised jumped at the first fine-tuning round in {jumped(illegible)} runs, those "
        f"at {LEGIBLE_PERCENT:.0f}% or more in {jumped(legible)}: fine-tuning every local model on mostly "
        "unrecognisable digits does not teach it the classes it never saw. The digits follow the clients' own "
        "training of the VTC: with fewer rounds (a client visits 2-3 times in T = 5 rounds at participation 0.5) or "
        "shorter visits (E = 1 or 2) most of them are not recognisable, and FedVTC ends below the baselines at most "
        "seeds.",
        "",
        "The same two checks at every budget, and the share of recognised digits (FedVTC with `L_tc`, the configs' "
        "variant):",
        "",
        "| budget | recognised synthetic digits | FedVTC final | FedProto | FedTGP | above both | jumps at fine-tuning "
        "start |",
        "|---|---|---|---|---|---|---|",
    ]
    for budget in BUDGETS:
        t = tally(results, f"{budget}/fedvtc")
        if t["rows"]:
            lines.append(f"| `{budget}` | {_mean(t['rows'], 'recognised')}% | {finals(budget, 'fedvtc')} | "
                         f"{finals(budget, 'fedproto')} | {finals(budget, 'fedtgp')} | {len(t['above'])} of "
                         f"{t['paired']} | {t['jumps']} of {len(t['rows'])} |")
    if paper["rows"]:
        lines += [
            "",
            f"At each client's schedule of the paper (`{PAPER_SCHEDULE}`: `--rounds 20`, 8-10 minutes on 2 CPU "
            f"cores) FedVTC ends above both at {len(paper['above'])} of {paper['paired']} seeds; "
            "[fedvtc_mnist.md](fedvtc_mnist.md) compares every method at that schedule.",
        ]
    return lines + [""]


def write_page(results: dict[str, list[dict[str, Any]]], seeds: list[int], reuse: Path | None = None) -> None:
    """``docs/results/fedvtc_config.md``: the per-seed acceptance per budget, the verdicts, every row and every run."""
    lines = [
        "# FedVTC in the `mnist_vtc` configs: the acceptance check, and how it depends on the schedule",
        "",
        "Generated by `python reproductions/fedvtc_config.py --seeds " + " ".join(map(str, seeds))
        + (" --reuse docs/results/fedvtc_config.json" if reuse is not None else "") + "` from the configs "
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
        *where_and_why_not(results),
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
    reused = sum(bool(r.get("reused")) for rows in results.values() for r in rows)
    if reused:
        lines += ["", f"{reused} of these runs' records are the page's earlier ones (`--reuse`): their run directories "
                  "were not at hand when the page was last written."]
    lines += ["", "![acc_global across the rounds and the fine-tuning: E = 1, each client's schedule of the paper, and "
              "the shipped few-minute budget](fedvtc_config.png)", ""]
    write_atomic(OUT / "fedvtc_config.md", "\n".join(lines))


#: The rows drawn in the curves, and the budgets that get a panel (the shipped one last: it carries the legend).
CURVES = ("fedvtc", "fedvtc_e", *BASELINES)
PANELS = ("t20e1", PAPER_SCHEDULE, SHIPPED)


def main() -> None:
    """Run the missing runs, then write the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="*", default=None, help="row labels to run (budget/variant)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--report-only", action="store_true", help="write the page from the runs already complete")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="an earlier fedvtc_config.json: planned runs with no complete run under --root keep its "
                             "per-seed records")
    args = parser.parse_args()
    if not args.report_only:
        execute(plan(args.seeds, args.only), args.root, args.jobs)
    results = collect(plan(args.seeds, None), args.root)
    if args.reuse is not None:
        results = reuse_archived(results, json.loads(args.reuse.read_text())["results"], list(ROWS), args.seeds)
    series = {VARIANTS[variant][2]: [[r["curve"] if budget_of(label) == budget else [] for budget in PANELS]
                                     for label in (f"{b}/{variant}" for b in PANELS) for r in results.get(label, [])]
              for variant in CURVES}
    curves_png(OUT / "fedvtc_config.png", series,
               [f"{b}: acc_global over the rounds, then fine-tuning / extra rounds" for b in PANELS],
               highlight=lambda name: name.startswith("FedVTC"))
    synthetic_images(args.root, 0, f"{SHIPPED}/fedvtc", grid=OUT / "fedvtc_config_images.png")
    write_atomic(OUT / "fedvtc_config.json", json.dumps({"machine_here": THIS_MACHINE, "budgets": BUDGETS,
                                                         "results": results}, indent=1, sort_keys=True))
    write_page(results, args.seeds, args.reuse)


if __name__ == "__main__":
    main()
