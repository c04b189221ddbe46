"""FedFTG's comparison on embedded MNIST: Table 3 (each base with and without FTG), Table 2, Table 4.

Every row uses ``configs/experiments/mnist_ftg/`` (20 equal-size clients with Dir(beta) label
mixtures over all 5,000 embedded MNIST digits, 5 active per round, FedFTG's small CNN, one
client optimizer: SGD 0.1, no momentum, weight decay 1e-3, gradients clipped at 10, 2 local
epochs of batch 32 per round), so rows differ only in the method:

* Table 3: ``<base>`` and ``fedftg_<base>`` for FedAvg, FedProx, FedDyn, SCAFFOLD and MOON, at
  beta = 0.3 and 0.6;
* Table 2: rounds until the server model first reaches ``--target`` percent (``None``: never);
* Table 4 (beta = 0.3, FedFTG on FedAvg): ``-hsm`` (generator not adversarial: fidelity and
  diversity only), ``-cls`` (uniform labels), ``-abe`` (uniform teacher weights), and
  ``fidelity_only`` (fidelity loss alone, the sanity check that a non-adversarial generator
  helps less);
* Table 1 extras at beta = 0.3: FedGen (no server model here: client accuracy on the global
  test) and FedDF's server form (on public photos).

Values are ``acc_server`` (the global model on the 1,000-image global test set) as the mean of
the last 3 evaluated rounds and as the final round, mean ± std over seeds. The server's cost per
round is measured from each run's ``time/`` records against the clients' fit time.

    python reproductions/fedftg_mnist.py --seeds 0 1 2 --jobs 2 [--rounds 20] [--report_only]

Runs live in ``--root`` (default ``runs/fedftg_mnist``) and resume where they stopped; the page goes
to ``docs/results/fedftg_mnist.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from comparison import REPO, Run, cell, execute, load, mean_std, write_atomic

FOLDER = "configs/experiments/mnist_ftg"
BASES = ("fedavg", "fedprox", "feddyn", "scaffold", "moon")
BETAS = (0.3, 0.6)
ABLATIONS = {
    "-hsm": ("--method.init_args.hard_sample_mining=false",),
    "-cls": ("--method.init_args.label_sampling=false",),
    "-abe": ("--method.init_args.class_ensemble=false",),
    "fidelity_only": ("--method.init_args.hard_sample_mining=false", "--method.init_args.lambda_dis=0"),
}
EXTRAS = ("fedgen", "feddf_server")
#: The extras are not part of the default grid (``--extras`` adds them): the CPU budget goes to Tables 3 and 4.
#: Runs of the comparison are evaluated on one client only and every second round (acc_server is the
#: metric; rounds to target are then counted at even rounds): the CPU budget goes to the server steps.
COMMON = ("--federation.eval_clients=1", "--federation.eval_every=2")


def beta_flag(beta: float) -> str:
    """The override that sets the Dirichlet concentration of the client label mixtures."""
    return f"--scenario.partitioner.init_args.omega={beta}"


def plan(seeds: list[int], rounds: int, extras: bool = False) -> list[Run]:
    """Every run, seed by seed (so a stopped comparison has whole seeds), cheapest rows first."""
    runs = []
    for seed in seeds:
        common = (*COMMON, f"--rounds={rounds}")
        for beta in BETAS:
            for base in BASES:
                for name in (base, f"fedftg_{base}"):
                    flags = (*common, beta_flag(beta))
                    runs.append(Run(f"b{beta}/{name}", f"{FOLDER}/{name}.yaml", seed, flags))
        for label, switches in ABLATIONS.items():
            flags = (*common, beta_flag(0.3), *switches)
            runs.append(Run(f"b0.3/fedftg_fedavg{label}", f"{FOLDER}/fedftg_fedavg.yaml", seed, flags))
        for name in EXTRAS if extras else ():
            runs.append(Run(f"b0.3/{name}", f"{FOLDER}/{name}.yaml", seed, (*common, beta_flag(0.3))))
    return runs


def series(history: list[dict], key: str) -> list[float]:
    """The evaluated values of ``key``, round by round."""
    return [r[key] for r in history if key in r]


def row(runs: list[Run], root: Path, key: str, target: float) -> dict | None:
    """Per-seed values of one row: last-3 mean, final, best, rounds to target, server and client seconds."""
    done = [r for r in runs if (r.run_dir(root) / "summary.json").exists()]
    if not done:
        return None
    out: dict = {"seeds": [r.seed for r in done], "last3": [], "final": [], "max": [], "rounds_to_target": []}
    out.update({"server_s": [], "fit_s": []})
    for run in done:
        history = load(run, root)["history"]
        values = series(history, key)
        out["last3"].append(sum(values[-3:]) / len(values[-3:]))
        out["final"].append(values[-1])
        out["max"].append(max(values))
        reached = next((r["round"] + 1 for r in history if key in r and r[key] >= target), None)
        out["rounds_to_target"].append(reached)
        # fit_s is the clients' fit time; the server round is what the round took beyond fitting and evaluating.
        out["fit_s"].append(sum(r["time/fit_s"] for r in history) / len(history))
        out["server_s"].append(
            sum(r["time/round_s"] - r["time/fit_s"] - r["time/eval_s"] for r in history) / len(history)
        )
    return out


def pm(values: list[float]) -> str:
    """``mean ± std`` of per-seed values, ``-`` when there are none."""
    return cell(values) if values else "-"


def rounds_cell(values: list[int | None]) -> str:
    """Mean ± std rounds to target over the seeds that reached it, naming those that never did."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "not reached"
    mean, std = mean_std([float(v) for v in reached])
    suffix = "" if len(reached) == len(values) else f" ({len(values) - len(reached)} of {len(values)} never)"
    return f"{mean:.1f} ± {std:.1f}{suffix}"


def report(root: Path, seeds: list[int], rounds: int, target: float) -> dict:
    """Write the page (Markdown, JSON, PNG) from every finished run."""
    runs = plan(seeds, rounds, extras=True)
    labels = list(dict.fromkeys(r.label for r in runs))
    results = {}
    for label in labels:
        key = "acc_global" if label.endswith("/fedgen") else "acc_server"
        data = row([r for r in runs if r.label == label], root, key, target)
        if data is not None:
            results[label] = {"metric": key, **data}

    def get(label: str, field: str = "last3") -> str:
        return pm(results[label][field]) if label in results else "-"

    def gain(label: str, base: str) -> str:
        if label not in results or base not in results:
            return "-"
        pairs = [
            (a, b)
            for s, a in zip(results[label]["seeds"], results[label]["last3"], strict=True)
            for t, b in zip(results[base]["seeds"], results[base]["last3"], strict=True)
            if s == t
        ]
        if not pairs:
            return "-"
        mean, std = mean_std([a - b for a, b in pairs])
        return f"{mean:+.2f} ± {std:.2f}"

    seed_list = " ".join(map(str, seeds))
    command = f"python reproductions/fedftg_mnist.py --seeds {seed_list} --rounds {rounds} --target {target:g}"
    lines = [
        "# FedFTG on embedded MNIST (CPU variant of the paper's Tables 1-4)",
        "",
        f"Command: `{command}` ({rounds} rounds; seeds {', '.join(map(str, seeds))}). Scenario and budget: "
        "`configs/experiments/mnist_ftg/` (20 equal-size clients, Dir(beta) label mixtures over all 5,000 embedded "
        "MNIST digits, 5 active clients per round, FedFTG's small CNN without BatchNorm; every row SGD 0.1, no "
        "momentum, weight decay 1e-3, clipping at 10, 2 local epochs of batch 32, about 12 steps), evaluated every "
        "second round. FedFTG: I = 10, I_g = 1 (one "
        "step on the alpha-weighted sum, the paper's form), I_d = 5, Q = 32, d = 64, generator width 16.",
        "",
        "Values: `acc_server`, the global model on the 1,000-image global test set, mean of the last 3 "
        "evaluations (rounds 6, 8 and 10 at 10 rounds; mean ± std over seeds); `final`: the last round; `gain`: "
        "FTG minus its base, paired by seed (mean ± std of the per-seed differences).",
        "",
        "## Table 3: each base with and without FedFTG",
        "",
        "| base | β=0.3 base | β=0.3 +FTG | β=0.3 gain | β=0.6 base | β=0.6 +FTG | β=0.6 gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for base in BASES:
        cells = []
        for beta in BETAS:
            b, f = f"b{beta}/{base}", f"b{beta}/fedftg_{base}"
            cells += [get(b), get(f), gain(f, b)]
        lines.append(f"| {base} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Table 2: rounds to reach {target:g}% (β = 0.3 and 0.6)",
        "",
        "| method | β=0.3 | β=0.6 |",
        "|---|---|---|",
    ]
    for base in BASES:
        for name in (base, f"fedftg_{base}"):
            cells = [
                rounds_cell(results[f"b{beta}/{name}"]["rounds_to_target"]) if f"b{beta}/{name}" in results else "-"
                for beta in BETAS
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Table 4: ablation (β = 0.3, FedFTG on FedAvg)",
        "",
        "| variant | acc_server (last 3) | final | gain over FedAvg |",
        "|---|---|---|---|",
        "| FedFTG | " + " | ".join(
            [get("b0.3/fedftg_fedavg"), get("b0.3/fedftg_fedavg", "final"), gain("b0.3/fedftg_fedavg", "b0.3/fedavg")]
        ) + " |",
    ]
    for label in ABLATIONS:
        name = f"b0.3/fedftg_fedavg{label}"
        lines.append(f"| {label} | {get(name)} | {get(name, 'final')} | {gain(name, 'b0.3/fedavg')} |")
    lines += [
        "",
        "## Table 1 extras (β = 0.3)",
        "",
        "| method | metric | last 3 | final |",
        "|---|---|---|---|",
    ]
    for name in EXTRAS:
        label = f"b0.3/{name}"
        if label in results:
            lines.append(f"| {name} | {results[label]['metric']} | {get(label)} | {get(label, 'final')} |")
    lines += ["", "## Verdicts (computed from the tables above)", ""]
    lines += verdicts(results, rounds)
    lines += ["", "## Server cost per round (seconds, mean over rounds and seeds)", ""]
    lines += ["| method | clients' fit | server (aggregate + refine) | ratio |", "|---|---|---|---|"]
    for label in ("b0.3/fedavg", "b0.3/fedftg_fedavg", "b0.3/scaffold", "b0.3/fedftg_scaffold", "b0.3/feddf_server"):
        if label in results:
            fit, server = mean_std(results[label]["fit_s"])[0], mean_std(results[label]["server_s"])[0]
            lines.append(f"| {label[5:]} | {fit:.2f} | {server:.2f} | {server / max(fit, 1e-9):.2f} |")
    lines.append("")
    write_atomic(REPO / "docs/results/fedftg_mnist.md", "\n".join(lines) + "\n")
    write_atomic(REPO / "docs/results/fedftg_mnist.json", json.dumps(results, indent=2))
    plot(root, runs, REPO / "docs/results/fedftg_mnist.png")
    return results


def paired_gain(results: dict, label: str, base: str, field: str = "last3") -> float | None:
    """Mean over shared seeds of ``label`` minus ``base`` (``None`` when either is missing)."""
    if label not in results or base not in results:
        return None
    ours = dict(zip(results[label]["seeds"], results[label][field], strict=True))
    theirs = dict(zip(results[base]["seeds"], results[base][field], strict=True))
    shared = sorted(set(ours) & set(theirs))
    return sum(ours[s] - theirs[s] for s in shared) / len(shared) if shared else None


def verdicts(results: dict, rounds: int) -> list[str]:
    """One line per claim of the paper, decided by the paired gains (no threshold tuning)."""
    lines = []
    gains = {
        (base, beta): paired_gain(results, f"b{beta}/fedftg_{base}", f"b{beta}/{base}")
        for base in BASES
        for beta in BETAS
    }
    known = {k: v for k, v in gains.items() if v is not None}
    if known:
        losing = [f"{base} at β={beta} ({gain:+.2f})" for (base, beta), gain in known.items() if gain <= 0]
        verdict = "holds" if not losing else f"does not hold for {len(losing)} of {len(known)}: " + ", ".join(losing)
        lines.append(f"* **FTG improves every base** (Table 3, last-3 mean, paired by seed): {verdict}.")
        by_base = [
            (base, gains[(base, 0.3)], gains[(base, 0.6)])
            for base in BASES
            if gains[(base, 0.3)] is not None and gains[(base, 0.6)] is not None
        ]
        if by_base:
            larger = [base for base, small, large in by_base if small > large]
            lines.append(
                f"* **The gain grows as β shrinks** (0.6 → 0.3): larger at β=0.3 for {len(larger)} of {len(by_base)} "
                f"bases ({', '.join(larger) or 'none'}); "
                + "; ".join(f"{base} {small:+.2f} vs {large:+.2f}" for base, small, large in by_base)
                + "."
            )
    full = paired_gain(results, "b0.3/fedftg_fedavg", "b0.3/fedavg")
    if full is not None:
        parts = []
        for label in ("-hsm", "-cls", "-abe"):
            ablated = paired_gain(results, f"b0.3/fedftg_fedavg{label}", "b0.3/fedavg")
            if ablated is not None:
                parts.append(f"{label} {ablated:+.2f} ({'contributes' if ablated < full else 'does not contribute'})")
        if parts:
            head = f"* **Each component contributes** (Table 4, gain over FedAvg; full FTG {full:+.2f}): "
            lines.append(head + ", ".join(parts) + ".")
        fidelity = paired_gain(results, "b0.3/fedftg_fedavg" + "fidelity_only", "b0.3/fedavg")
        if fidelity is not None:
            verdict = "holds" if fidelity < full else "does not hold"
            lines.append(
                f"* **A generator trained on fidelity alone helps less** (sanity check): {verdict} "
                f"({fidelity:+.2f} vs {full:+.2f})."
            )
    faster, total = 0, 0
    for base in BASES:
        for beta in BETAS:
            plain, tuned = results.get(f"b{beta}/{base}"), results.get(f"b{beta}/fedftg_{base}")
            if plain is None or tuned is None:
                continue
            never = rounds + 1  # a seed that never reaches the target counts as one round past the budget
            first = [v if v is not None else never for v in plain["rounds_to_target"]]
            second = [v if v is not None else never for v in tuned["rounds_to_target"]]
            total += 1
            faster += sum(second) < sum(first)
    if total:
        lines.append(f"* **FTG reaches the target in fewer rounds** (Table 2): for {faster} of {total} base/β pairs.")
    return lines


def plot(root: Path, runs: list[Run], path: Path) -> None:
    """acc_server per round (mean over seeds) of each base and its FTG form at beta 0.3 and 0.6."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, beta in zip(axes, BETAS, strict=True):
        for index, base in enumerate(BASES):
            for name, style in ((base, "--"), (f"fedftg_{base}", "-")):
                done = [
                    r for r in runs if r.label == f"b{beta}/{name}" and (r.run_dir(root) / "summary.json").exists()
                ]
                curves = [series(load(r, root)["history"], "acc_server") for r in done]
                if not curves:
                    continue
                length = min(len(c) for c in curves)
                mean = [sum(c[i] for c in curves) / len(curves) for i in range(length)]
                ax.plot(range(1, length + 1), mean, style, color=f"C{index}", label=name)
        ax.set_title(f"Dir(β = {beta})")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acc_server (%)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Run (resumably) and write the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--extras", action="store_true", help="also run FedGen and FedDF's server form (beta 0.3)")
    parser.add_argument("--target", type=float, default=80.0, help="rounds-to-target threshold (percent)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--root", type=Path, default=REPO / "runs/fedftg_mnist")
    parser.add_argument("--report_only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        execute(plan(args.seeds, args.rounds, args.extras), args.root, args.jobs)
    report(args.root, args.seeds, args.rounds, args.target)
    print((REPO / "docs/results/fedftg_mnist.md").read_text())


if __name__ == "__main__":
    main()
