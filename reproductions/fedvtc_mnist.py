"""FedVTC against its Table 1 baselines on all 5,000 embedded MNIST digits (spec's CPU variant).

Every method runs from its shipped config, ``configs/experiments/mnist_vtc/<method>.yaml``, with
the flags of :data:`BUDGET`: each client's schedule of the paper, T = 20 rounds of the configs'
E = 5 local epochs (10 clients of five heterogeneous small models, half of them per round: each
client visits about 10 times, as in the paper), batch 16, the same optimizer for every method,
then FedVTC's psi upload and 5 fine-tuning rounds of 5 epochs or the baselines' 5 extra
full-participation rounds of E = 5 (their configs' ``federation.extra_rounds``). The configs
themselves ship T = 10 rounds, a few CPU minutes, at which FedVTC's VTC decodes fewer
recognisable digits and its lead is smaller; ``fedvtc_config.py`` compares the budgets. Dir(0.1) is
the configs' partition; Dir(1.0) overrides its beta. The T = 20, E = 5 Dir(0.1) runs of
``fedvtc_config.py`` are the same runs as this grid's (same config, seed and schedule).

Metric: the paper's "generalization accuracy", every client's local model on the held-out global
test set (the 1,000 test digits), averaged over clients (``acc_global``), after the last step.
Communication: the bytes the round loop measured from payloads (Table 2's quantity).
Ablations (spec 7): L_tc vs L_e (Table 4), psi averaged once vs every round (Table 3), and
with vs without fine-tuning (FedVTC's accuracy right after round T, in the same runs).
Synthetic images: the last FedVTC run of seed 0 is decoded (S/C per class from the final global
psi, prototypes and sigma); a held-out classifier trained on the global test digits only (never
seen by any client) scores them.

Writes ``docs/results/fedvtc_mnist.{md,json,png}`` and ``docs/results/fedvtc_mnist_images.png``.
Run: ``python reproductions/fedvtc_mnist.py --seeds 0 1 2`` (each run with its config's two
single-thread worker processes, one run at a time: about 8-10 minutes per FedVTC run on this 2-core
machine; the first grid ran two runs at a time with one process each, about 15 minutes per FedVTC
run and 5-7 per baseline run). ``--only fedvtc fedproto`` runs a subset (rows not run are listed
on the page). Runs already complete are reused; ``--reuse docs/results/fedvtc_mnist.json`` keeps
the page's earlier per-seed records for the runs not under ``--root`` (the json holds every run's
numbers and curve), so a subset re-run after a fix updates its rows without re-running the rest.
A run directory may hold a ``provenance.json`` (``{"machine": ...}``) when it
ran elsewhere; the page names those runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from comparison import REPO, Run, execute, load, mean_std, reuse_archived, write_atomic

from fedhet.bench import curves_png as _curves_png

# Order = execution priority (the page says which rows did not run).
ROWS = {
    "dir0.1/fedvtc": ("fedvtc", ()),
    "dir0.1/fedproto": ("fedproto", ()),
    "dir0.1/fedtgp": ("fedtgp", ()),
    "dir0.1/ccvr": ("ccvr", ()),
    "dir0.1/fedtype": ("fedtype", ()),
    "dir0.1/fedgen": ("fedgen", ()),
    "dir0.1/fedvtc_e": ("fedvtc_e", ()),
    "dir0.1/fedvtc psi once": ("fedvtc", ("--method.init_args.psi_sync=once",)),
    "dir1.0/fedvtc": ("fedvtc", ("--scenario.partitioner.init_args.beta=1.0",)),
    "dir1.0/fedproto": ("fedproto", ("--scenario.partitioner.init_args.beta=1.0",)),
    "dir1.0/fedtgp": ("fedtgp", ("--scenario.partitioner.init_args.beta=1.0",)),
    "dir1.0/ccvr": ("ccvr", ("--scenario.partitioner.init_args.beta=1.0",)),
    "dir1.0/fedtype": ("fedtype", ("--scenario.partitioner.init_args.beta=1.0",)),
    "dir1.0/fedgen": ("fedgen", ("--scenario.partitioner.init_args.beta=1.0",)),
}
NAMES = {"fedvtc": "FedVTC", "fedvtc_e": "FedVTC (L_e)", "fedproto": "FedProto", "fedtgp": "FedTGP",
         "fedgen": "FedGen", "ccvr": "CCVR", "fedtype": "FedType"}
LR = "0.05"
#: Flags on top of every config: each client's schedule of the paper, T = 20 rounds of the configs' E = 5 epochs
#: (the configs ship T = 10, a few CPU minutes, at which FedVTC's VTC decodes fewer digits: fedvtc_config.md),
#: and each round evaluated, for the curves.
BUDGET = ["--rounds", "20", "--federation.eval_every=1"]
PAPER = {  # Table 1 MNIST, Table 3 and Table 4 (percent)
    "dir0.1": {"fedproto": 83.4, "fedtgp": 85.4, "fedgen": 81.1, "ccvr": 85.5, "fedtype": 83.9, "fedvtc": 88.7,
               "fedvtc_e": 87.2, "fedvtc psi once": 88.7},
    "dir1.0": {"fedproto": 86.1, "fedtgp": 86.8, "fedgen": 81.9, "ccvr": 86.2, "fedtype": 86.7, "fedvtc": 90.1},
}
OUT = REPO / "docs" / "results"
#: Further seed-0 FedVTC runs whose synthetic digits are scored (no grid): one-shot psi, L_e, Dir(1.0).
SCORED = ("dir0.1/fedvtc psi once", "dir0.1/fedvtc_e", "dir1.0/fedvtc")
ROOT = REPO / "runs" / "fedvtc_mnist"
THIS_MACHINE = f"this 2-core machine (CPU, torch {torch.__version__})"


def machine_of(run_dir: Path) -> str:
    """Where a run ran: its ``provenance.json``'s machine, or this one."""
    provenance = run_dir / "provenance.json"
    return json.loads(provenance.read_text())["machine"] if provenance.is_file() else THIS_MACHINE


def partition_name(partition: str) -> str:
    """``dir0.1`` -> ``Dir(0.1)``."""
    return partition.replace("dir", "Dir(") + ")"


def plan(seeds: list[int], only: list[str] | None) -> list[Run]:
    """Every row (or the ``only`` ones) at every seed."""
    runs = []
    for label, (method, flags) in ROWS.items():
        if only and not any(label.endswith("/" + o) or label == o for o in only):
            continue
        config = f"configs/experiments/mnist_vtc/{method}.yaml"
        runs += [Run(label, config, seed, tuple(BUDGET) + flags) for seed in seeds]
    return runs


def collect(runs: list[Run], root: Path) -> dict[str, Any]:
    """Per row: each complete seed's final and after-round-T accuracy, traffic, time, curve and machine."""
    results: dict[str, Any] = {}
    for run in runs:
        if not (run.run_dir(root) / "summary.json").is_file():
            continue
        summary = load(run, root)
        history = summary["history"]
        evaluated = [r for r in history if "acc_global" in r]
        rounds = [r for r in evaluated if "phase" not in r]
        curve = [r for r in evaluated if r.get("phase") != "vtc_sync"]  # aligned with the baselines' extra rounds
        row = {
            "seed": run.seed,
            "final": evaluated[-1]["acc_global"],
            "after_rounds": rounds[-1]["acc_global"],  # before fine-tuning / extra rounds
            "final_local": evaluated[-1].get("acc_local", float("nan")),
            "bytes_total": summary["comm"]["bytes_up"] + summary["comm"]["bytes_down"],
            "wall_s": summary["wall_s"],
            "curve": [r["acc_global"] for r in curve],
            "phases": [r.get("phase", "federation") for r in curve],
            "machine": machine_of(run.run_dir(root)),
        }
        results.setdefault(run.label, {"seeds": []})["seeds"].append(row)
    return results


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Every row's mean and std over its seeds, of each per-run number."""
    for entry in results.values():
        for key in ("final", "after_rounds", "final_local", "bytes_total", "wall_s"):
            mean, std = mean_std([r[key] for r in entry["seeds"]])
            entry[f"{key}_mean"], entry[f"{key}_std"] = round(mean, 4), round(std, 4)
    return results


def reuse_records(results: dict[str, Any], archived: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """Add an earlier page's per-seed records for the planned runs with no complete run under the root."""
    fresh = {label: entry["seeds"] for label, entry in results.items()}
    earlier = {label: entry["seeds"] for label, entry in archived["results"].items()}
    per_label = reuse_archived(fresh, earlier, list(ROWS), seeds)
    return {label: {"seeds": records} for label, records in per_label.items()}


def cell(entry: dict[str, Any] | None, key: str = "final", planned: bool = True) -> str:
    """``mean ± std (n, seeds)`` of a row, or why it has none."""
    if entry is None:
        return "not run" if planned else "not in the plan"
    seeds = ",".join(str(r["seed"]) for r in entry["seeds"])
    return f"{entry[f'{key}_mean']:.2f} ± {entry[f'{key}_std']:.2f} (n={len(entry['seeds'])}, seeds {seeds})"


def synthetic_images(
    root: Path, seed: int = 0, label: str = "dir0.1/fedvtc", grid: Path | None = OUT / "fedvtc_mnist_images.png",
    per_class: int = 10,
) -> dict[str, Any] | None:
    """Decode the final FedVTC state of ``label`` seed ``seed`` and score it with a held-out classifier.

    ``grid``: where to draw the scored digits (one row per class), or ``None``.

    The record also holds the geometry of the state's prototypes and the norm of its ``sigma``.

    The state is the run's ``checkpoint.pt``, or its ``server_vtc.pt`` (the server's ``vtc``,
    ``prototypes`` and ``sigma`` alone) where the checkpoint was not kept. The scorer trains on one
    thread, so a state gets the same score on every machine with the same torch: the held-out
    classifier's weights, and with them a borderline digit's verdict, change with the thread count.
    """
    run = root / label / f"seed{seed}"
    checkpoint = run / "checkpoint.pt" if (run / "checkpoint.pt").is_file() else run / "server_vtc.pt"
    if not checkpoint.is_file():
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _score_synthetic(checkpoint, seed, grid, per_class)
    finally:
        torch.set_num_threads(threads)


def _score_synthetic(checkpoint: Path, seed: int, grid: Path | None, per_class: int) -> dict[str, Any]:
    import yaml

    from fedhet.algorithms.fedvtc import VTCDecoder, decode_latents
    from fedhet.data import LabelSkewScenario
    from fedhet.functional.vtc import prototype_geometry, reparameterize
    from fedhet.models import create_model

    state = torch.load(checkpoint, weights_only=True, map_location="cpu")
    server = state.get("server", state)
    decoder = VTCDecoder((20, 7, 7), (16, 32, 32), 1)
    decoder.load_state_dict(server["vtc"])
    config = yaml.safe_load((checkpoint.parent / "config.yaml").read_text())
    mode = config["method"]["init_args"].get("synthetic_bn", "running")  # as the clients decoded their sets
    labels = torch.arange(10).repeat_interleave(per_class)
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(len(labels), 980, generator=generator)
    latents = reparameterize(server["prototypes"][labels], server["sigma"].log(), noise)
    images = decode_latents(decoder, latents, mode)
    other = decode_latents(decoder, latents, "batch" if mode == "running" else "running")
    # held-out classifier: the scenario's global test digits (never used for training by a client)
    scenario = LabelSkewScenario(dataset="mnist_all", num_clients=10, pool_train_test=False, global_test_size=None,
                                 global_val_size=100, image_size=28, seed=seed)
    scenario.setup()
    test = next(iter(scenario.eval_sets("test").values()))
    mean = torch.tensor(scenario.mean).view(1, -1, 1, 1)
    std = torch.tensor(scenario.std).view(1, -1, 1, 1)
    xs, ys = zip(*scenario.eval_loader(test), strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    torch.manual_seed(0)
    model = create_model("simple_cnn", num_classes=10, in_channels=3, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(15):
        order = torch.randperm(len(x))
        for start in range(0, len(x), 32):
            index = order[start:start + 32]
            loss = torch.nn.functional.cross_entropy(model(x[index]), y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        predicted = model((images.expand(-1, 3, -1, -1) - mean) / std).argmax(1)
        predicted_other = model((other.expand(-1, 3, -1, -1) - mean) / std).argmax(1)
    per_class_acc = [(predicted[labels == c] == c).float().mean().item() * 100 for c in range(10)]
    if grid is not None:
        beta = config["scenario"]["init_args"]["partitioner"]["init_args"]["beta"]
        budget = f"T = {config['rounds']}, E = {config['trainer']['max_epochs']}"
        _grid_png(grid, images, per_class, f"seed {seed}, Dir({beta}), {budget}")
    return {"recognised_percent": (predicted == labels).float().mean().item() * 100, "per_class": per_class_acc,
            "synthetic_bn": mode,
            "recognised_percent_other_bn": (predicted_other == labels).float().mean().item() * 100,
            "chance_percent": 10.0, "samples_per_class": per_class,
            **{key: float(value) for key, value in zip(("prototype_norm", "prototype_min_distance"),
                                                       prototype_geometry(server["prototypes"]), strict=True)},
            "sigma_norm": float(server["sigma"].norm())}


def _grid_png(path: Path, images: torch.Tensor, per_class: int, run: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(10, per_class, figsize=(per_class * 0.6, 6.2))
    for index, ax in enumerate(axes.flat):
        ax.imshow(images[index, 0].numpy(), cmap="gray", vmin=0, vmax=1)
        ax.set_axis_off()
    fig.suptitle(f"FedVTC synthetic digits (row = class 0..9), {run}", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves_png(path: Path, results: dict[str, Any]) -> None:
    """acc_global per step, mean over seeds, one panel per partition; FedVTC bold.

    The steps are the T rounds, then FedVTC's fine-tuning rounds or the baselines' extra rounds
    (FedVTC's psi-upload step, which trains nothing, is left out so that both line up).
    """
    panels = ("dir0.1", "dir1.0")
    series: dict[str, list[list[list[float]]]] = {}
    for label, entry in results.items():
        partition, name = label.split("/", 1)
        for r in entry["seeds"]:
            series.setdefault(NAMES.get(name, name), []).append(
                [r["curve"] if partition == panel else [] for panel in panels])
    rounds = {r["phases"].count("federation") for e in results.values() for r in e["seeds"]}
    titles = [f"{partition_name(panel)}: acc_global over rounds 1-{max(rounds, default=0)}, then 5 "
              "fine-tuning / extra rounds" for panel in panels]
    _curves_png(path, series, titles, highlight=lambda name: name.startswith("FedVTC"))


def verdicts(results: dict[str, Any]) -> list[str]:
    """One line per claim of the paper: holds or not here, with the means and the per-seed count."""

    def get(label: str, key: str = "final") -> float | None:
        return results[label][f"{key}_mean"] if label in results else None

    def seeds_above(label: str, other: str) -> str:
        """``k of n seeds``: seeds both rows ran at which ``label`` ends above ``other``."""
        mine = {r["seed"]: r["final"] for r in results[label]["seeds"]}
        theirs = {r["seed"]: r["final"] for r in results[other]["seeds"]}
        shared = sorted(mine.keys() & theirs.keys())
        return f"above at {sum(mine[s] > theirs[s] for s in shared)} of {len(shared)} shared seeds"

    lines = []
    for partition in ("dir0.1", "dir1.0"):
        vtc_label, shown = f"{partition}/fedvtc", partition_name(partition)
        for baseline in ("fedproto", "fedtgp", "ccvr", "fedtype", "fedgen"):
            claim = f"- FedVTC > {NAMES[baseline]} at {shown} (Table 1): "
            vtc, value = get(vtc_label), get(f"{partition}/{baseline}")
            if vtc is None or value is None:
                lines.append(claim + "not run.")
                continue
            lines.append(claim + f"{'holds' if vtc > value else 'does not hold'} here ({vtc:.2f} vs {value:.2f}; "
                         f"{seeds_above(vtc_label, f'{partition}/{baseline}')}).")
        before, after = get(vtc_label, "after_rounds"), get(vtc_label)
        if before is not None and after is not None:
            jumped = "holds" if after > before + 1 else "does not hold"
            lines.append(f"- Accuracy jumps when fine-tuning starts (Fig. 7), {shown}: {jumped} here "
                         f"({before:.2f} after round T -> {after:.2f} after fine-tuning).")
    vtc, e = get("dir0.1/fedvtc"), get("dir0.1/fedvtc_e")
    if vtc is not None and e is not None:
        lines.append(f"- L_tc >= L_e (Table 4): {'holds' if vtc >= e else 'does not hold'} here ({vtc:.2f} vs {e:.2f}; "
                     f"L_tc {seeds_above('dir0.1/fedvtc', 'dir0.1/fedvtc_e')}).")
    once = get("dir0.1/fedvtc psi once")
    if vtc is not None and once is not None:
        cost_every = get("dir0.1/fedvtc", "bytes_total")  # the configs average psi every round
        cost_once = get("dir0.1/fedvtc psi once", "bytes_total")
        holds = "holds" if once >= vtc - 2.0 and cost_once < cost_every else "does not hold"
        lines.append(f"- One-shot psi is within 2 points of per-round psi and cheaper (Table 3): {holds} here: "
                     f"accuracy {once:.2f} (once) vs {vtc:.2f} (every round), traffic {cost_once / 1e6:.2f} MB vs "
                     f"{cost_every / 1e6:.2f} MB.")
    comm = {k.split("/", 1)[1]: get(k, "bytes_total") for k in results if k.startswith("dir0.1/")}
    if "fedvtc" in comm:
        cheaper = [NAMES.get(k, k) for k, v in comm.items()
                   if v is not None and not k.startswith("fedvtc") and v <= comm["fedvtc"]]
        lines.append("- FedVTC has the least traffic (Table 2): " + ("holds here." if not cheaper else
                     f"does not hold here; cheaper or equal: {', '.join(cheaper)}."))
    return lines


def write_page(
    results: dict[str, Any], images: dict[str, Any] | None, seeds: list[int], root: Path, reuse: Path | None = None
) -> None:
    """``docs/results/fedvtc_mnist.md``: the tables, the images' score, the verdicts, what did not run."""
    reuse_flag = ""
    if reuse is not None:
        reuse_flag = f" --reuse {reuse.resolve().relative_to(REPO) if reuse.resolve().is_relative_to(REPO) else reuse}"
    lines = [
        "# FedVTC on embedded MNIST (all 5,000 digits): Table 1, Table 2 and the ablations at CPU scale",
        "",
        "Generated by `python reproductions/fedvtc_mnist.py --seeds " + " ".join(map(str, seeds)) + reuse_flag
        + "` from the configs "
        "in "
        "`configs/experiments/mnist_vtc/`, each run with " + " ".join(BUDGET) + " on top of its config and one "
        "intra-op thread. **Schedule** (the same for every method): the configs' 10 clients (five heterogeneous "
        "small models), 5 per round, E = 5 epochs and batch 16, at T = 20 rounds (`--rounds 20`: about 10 visits "
        "per client, as the paper's T = 100 at 10% participation; the configs ship T = 10, a few CPU minutes), SGD "
        f"lr {LR} with momentum 0.9 and gradients clipped to norm 5 for every method (the configs'; "
        "FedVTC's `max_grad_norm` in its local rounds and its fine-tuning; the baselines' "
        "`trainer.gradient_clip_val`), then FedVTC's psi upload and 5 fine-tuning rounds (5 epochs each over S = 500 "
        "synthetic digits) or the baselines' 5 extra full-participation rounds of 5 epochs. Dir(1.0) overrides the "
        "configs' beta = 0.1. The paper runs T = 100, 100 clients and ResNets with plain SGD 1e-4: absolute numbers "
        "are not comparable, orderings are what is checked. Why this schedule and not the configs' shorter "
        "one: [fedvtc_config.md](fedvtc_config.md).",
        "",
        "**Metric** (the paper's *generalization accuracy*): every client's local model on the held-out global test "
        "set (1,000 digits), averaged over clients (`acc_global`), after the last step; mean ± std over seeds (n = "
        "seeds that ran).",
        "",
        "## Table 1: generalization accuracy (%)",
        "",
        "| Method | Dir(0.1) | paper Dir(0.1) | Dir(1.0) | paper Dir(1.0) |",
        "|---|---|---|---|---|",
    ]
    for method in ("fedproto", "fedtgp", "fedgen", "ccvr", "fedtype", "fedvtc"):
        dir1 = cell(results.get(f"dir1.0/{method}"), planned=f"dir1.0/{method}" in ROWS)
        lines.append(f"| {NAMES[method]} | {cell(results.get(f'dir0.1/{method}'))} | {PAPER['dir0.1'][method]} | "
                     f"{dir1} | {PAPER['dir1.0'][method]} |")
    lines += [
        "",
        "## Table 2: total traffic (MB, measured from payloads, up + down), Dir(0.1)",
        "",
        "| Method | MB |",
        "|---|---|",
    ]
    for label, entry in results.items():
        if label.startswith("dir0.1/"):
            lines.append(f"| {label.split('/', 1)[1]} | {entry['bytes_total_mean'] / 1e6:.2f} |")
    lines += [
        "",
        "## Ablations (Dir(0.1))",
        "",
        "| Variant | acc_global | paper (MNIST 0.1) |",
        "|---|---|---|",
        f"| FedVTC, L_tc, psi every round (the configs, Table 3 ②) | {cell(results.get('dir0.1/fedvtc'))} | 89.7 |",
        f"| FedVTC, L_e only (lambda = 0, Table 4; psi every round) | {cell(results.get('dir0.1/fedvtc_e'))} | 87.2 |",
        f"| FedVTC, psi once (the paper's default, Table 3 ①) | {cell(results.get('dir0.1/fedvtc psi once'))} | 88.7 |",
        "| FedVTC without fine-tuning (after round T, same runs) | "
        f"{cell(results.get('dir0.1/fedvtc'), 'after_rounds')} | - |",
        "",
        "![accuracy across rounds and fine-tuning](fedvtc_mnist.png)",
        "",
        "## Synthetic images",
        "",
    ]
    if images is None:
        lines.append("Not produced (the seed-0 FedVTC run is missing).")
    else:
        lines += [
            f"10 digits per class decoded from the final global psi, prototypes and sigma of the seed-0 Dir(0.1) run, "
            f"its BatchNorm with the config's `synthetic_bn: {images['synthetic_bn']}` statistics (as the clients "
            f"decoded their synthetic sets). A held-out classifier (simple_cnn trained on the 1,000 global test "
            f"digits only) recognises **{images['recognised_percent']:.1f}%** of them (chance 10%; with the other "
            f"BatchNorm statistics {images['recognised_percent_other_bn']:.1f}%); per class: "
            + ", ".join(f"{c}: {v:.0f}%" for c, v in enumerate(images["per_class"])) + ".",
            "",
            "![synthetic digits](fedvtc_mnist_images.png)",
            "",
            "The same score for the seed-0 state of other FedVTC rows: "
            + (", ".join(f"{label}: {value:.1f}%" for label, value in images.get("other_runs", {}).items())
               or "none ran") + ".",
        ]
    here = [r["wall_s"] for entry in results.values() for r in entry["seeds"] if r["machine"] == THIS_MACHINE]
    elsewhere = sorted({f"{label} seed {r['seed']}: {r['machine']}" for label, entry in results.items()
                        for r in entry["seeds"] if r["machine"] != THIS_MACHINE})
    lines += ["", f"Measured: {len(here)} of the {sum(len(e['seeds']) for e in results.values())} completed runs ran "
              f"on {THIS_MACHINE}, one intra-op thread per process, {sum(here) / 60:.1f} min of loop wall time in all."]
    reused = sum(bool(r.get("reused")) for entry in results.values() for r in entry["seeds"])
    if reused:
        fresh = [label for label, entry in results.items() if not all(r.get("reused") for r in entry["seeds"])]
        lines += [f"{reused} runs' records are reused (`--reuse`) from the page's earlier `fedvtc_mnist.json` (their "
                  "run directories are no longer at hand; the json keeps every run's numbers and curve); rows run "
                  "anew for this page: " + (", ".join(fresh) or "none") + "."]
    if elsewhere:
        lines += ["Runs on another machine (same config, seed and torch numerics class; GPU kernels round "
                  "differently, so these seeds are not bitwise what this machine gives): " + "; ".join(elsewhere) + "."]
    lines += ["", "## Verdicts (this schedule)", "", *verdicts(results), ""]
    missing = [label for label in ROWS if label not in results]
    lines += ["## Not run", "", ("- " + "\n- ".join(missing)) if missing else "Everything in the plan ran.", ""]
    failed = []
    for run in plan(seeds, None):
        log = run.log_path(root)
        if log.is_file() and not (run.run_dir(root) / "summary.json").is_file():
            errors = [line for line in log.read_text().splitlines() if "error" in line]
            failed.append(f"- {run.label} seed {run.seed}: {errors[-1] if errors else 'interrupted (budget)'}")
    if failed:
        lines += ["## Runs that failed or were stopped (left out of the means; n above counts the rest)", "", *failed,
                  ""]
    write_atomic(OUT / "fedvtc_mnist.md", "\n".join(lines))


def main() -> None:
    """Run the plan (``--only`` a part of it), then write the page from every complete run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="*", default=None, help="row labels or method names to run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each")
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--report-only", action="store_true", help="write the page from the runs already complete")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="an earlier fedvtc_mnist.json: planned runs with no complete run under --root keep "
                             "its per-seed records (and its image scores if the seed-0 FedVTC run is missing)")
    args = parser.parse_args()
    runs = plan(args.seeds, args.only)
    if not args.report_only:
        execute(runs, args.root, args.jobs)
    all_runs = plan(args.seeds, None)
    results = collect(all_runs, args.root)
    archived = json.loads(args.reuse.read_text()) if args.reuse is not None else None
    if archived is not None:
        results = reuse_records(results, archived, args.seeds)
    results = summarise(results)
    images = synthetic_images(args.root)
    if images is None and archived is not None:
        images = archived.get("images")
    elif images is not None:
        images["other_runs"] = {}
        for label in SCORED:
            other = synthetic_images(args.root, label=label, grid=None)
            if other is not None:
                images["other_runs"][label] = other["recognised_percent"]
    curves_png(OUT / "fedvtc_mnist.png", results)
    write_atomic(OUT / "fedvtc_mnist.json", json.dumps({"budget": BUDGET, "results": results, "images": images},
                                                      indent=1, sort_keys=True))
    write_page(results, images, args.seeds, args.root, args.reuse)


if __name__ == "__main__":
    main()
