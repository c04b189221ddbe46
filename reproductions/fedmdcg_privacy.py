"""FedMD-CG's privacy table (Table 2 of the paper) and the server-distillation probe: not federated runs.

The FedMD-CG comparison itself (Tables 1 and 3) is a grid page: ``fedhet bench --grid
configs/grids/fedmdcg_mnist.yaml`` writes ``docs/results/fedmdcg_mnist.md``. What stays here is what is
not a ``fedhet fit`` run: the gradient-inversion attack of :mod:`fedhet.privacy` on a few training
digits per seed (``docs/results/fedmdcg_privacy.json``), and the tables of ``fedmdcg_kd_probe.py``
(``docs/results/fedmdcg_kd_probe.json``), both written to ``docs/results/fedmdcg_privacy.md``.

    python reproductions/fedmdcg_privacy.py [--seeds 0 1 2] [--attack_images 2] [--attack_steps 500]
        [--methods fedavg fedper lg_fedavg fedcg fedmdcg] [--report_only]

The attack reruns only when ``--report_only`` is not given (about 2 minutes on one thread);
``--methods`` reruns only those rows (the others are kept from the json, which must hold the same
settings). The reference rows (an all-black image, the training set's mean image, the attack's
untouched starting dummy; :func:`fedhet.privacy.reference_psnrs`) are recomputed on every rerun,
in seconds. FedCG's row attacks FedCG's own upload: the classifier's CE gradient and the
generator's adversarial gradient after the latent discriminator's step on ``F_i(x)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from fedhet.data import BalancedDirichletPartitioner, LabelSkewScenario  # noqa: E402
from fedhet.files import atomic_write_text  # noqa: E402
from fedhet.pages import claims_markdown  # noqa: E402
from fedhet.statistics import paired_difference  # noqa: E402

OUT = Path(os.environ.get("FEDMDCG_BENCH_OUT", REPO / "docs" / "results"))
NAME = "fedmdcg_privacy"
TITLE = "FedMD-CG: privacy (Table 2 layout) and what the server distillation does"

#: the authors' code flags the shipped FedMD-CG config uses (docs/fedmdcg.md); used by fedmdcg_kd_probe.py
CODE_FLAGS = {
    "ramp": "code",
    "lambda_feature_mse": 0.1,
    "client_temperature": 10.0,
    "server_temperature": 10.0,
    "server_loss_form": "code",
}


def scenario(seed: int, omega: float) -> LabelSkewScenario:
    """The mnist_mdcg scenario (configs/experiments/mnist_mdcg/*.yaml)."""
    return LabelSkewScenario(
        dataset="mnist_all",
        num_clients=10,
        partitioner=BalancedDirichletPartitioner(omega=omega),
        pool_train_test=False,
        global_test_size=None,
        global_val_size=100,
        local_test="test_shards",
        local_test_fraction=0.0,
        local_val_fraction=0.0,
        image_size=32,
        batch_size=64,
        seed=seed,
    )


METHODS = ("fedavg", "fedper", "lg_fedavg", "fedcg", "fedmdcg")
#: the gradient-free reference rows (keys of fedhet.privacy.reference_psnrs) and their labels
REFERENCES = {
    "all_black": "reference: all-black image",
    "dataset_mean": "reference: training-set mean image",
    "untouched_dummy": "reference: untouched attack dummy",
}

#: every row of the table, methods then references, with its label
LABELS = {"fedavg": "FedAvg", "fedper": "FedPer", "lg_fedavg": "LG-FedAvg", "fedcg": "FedCG", "fedmdcg": "FedMD-CG",
          **REFERENCES}  # fmt: skip
#: Table 2's claims (declared 2026-11-28, from the paper's text, after the 3-seed run they are read on):
#: ``better`` is the row whose reconstructions must be closer to the digits (higher PSNR) for the claim to hold.
CLAIMS = (
    ("FedMD-CG leaks less than FedAvg", "fedavg", "fedmdcg"),
    ("FedMD-CG leaks less than FedPer", "fedper", "fedmdcg"),
    *((f"{LABELS[row]}'s reconstructions resemble the digits less than the training-set mean image does "
       "(\"effectively prevent the privacy leakage\")", "dataset_mean", row)
      for row in ("fedmdcg", "lg_fedavg", "fedcg")),
)


def claim_results(psnr: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Each claim of :data:`CLAIMS` with its paired difference over the attacked digits and its verdict."""
    results = []
    for claim, better, than in CLAIMS:
        difference = paired_difference(dict(enumerate(psnr.get(better, []))), dict(enumerate(psnr.get(than, []))))
        results.append({"claim": claim, "paper": "FedMD-CG Table 2", "better": better, "than": than,
                        "metric": "PSNR (dB), whole model", **difference.as_dict()})  # fmt: skip
    return results


def privacy_cells(
    seeds: list[int], images: int, steps: int, methods: tuple[str, ...] = METHODS
) -> dict[str, dict[str, list[float]]]:
    """PSNR (dB) of the inversion attack per method, per attacker knowledge, over seeds x images.

    The reference rows (no gradient used) are scored on the same images by the same PSNR; they
    are the same under both attacker knowledges.
    """
    from fedhet.algorithms.fedcg import LatentDiscriminator
    from fedhet.algorithms.fedmdcg import ConditionalFeatureGenerator
    from fedhet.data.embedded import load_mnist_all
    from fedhet.privacy.gradient_inversion import DLGLeNet, denormalizer, invert_gradients, reference_psnrs

    splits = load_mnist_all(0)
    restore = denormalizer((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    dataset_mean = (splits.train.x.float() / 255.0).mean(0)
    out: dict[str, dict[str, list[float]]] = {"whole_model": {}, "uploads_only": {}}
    for seed in seeds:
        order = torch.randperm(len(splits.train), generator=torch.Generator().manual_seed(seed))[:images]
        victim = DLGLeNet(seed=100 + seed)
        guess = DLGLeNet(seed=200 + seed)
        generator = ConditionalFeatureGenerator(128, 10, victim.num_features).eval()
        torch.manual_seed(300 + seed)
        discriminator = LatentDiscriminator(victim.head, 10, conditional=True).eval()  # FedCG's, never uploaded
        torch.manual_seed(400 + seed)
        guess_discriminator = LatentDiscriminator(victim.head, 10, conditional=True).eval()
        for index in order.tolist():
            x = (splits.train.x[index : index + 1].float() / 255.0 - 0.5) / 0.5
            y = splits.train.y[index : index + 1].long()
            noise = torch.randn(1, 128, generator=torch.Generator().manual_seed(index))
            for name, value in reference_psnrs(x, restore, dataset_mean, seed=index).items():
                for knowledge in out:
                    out[knowledge].setdefault(name, []).append(round(value, 3))
            for method in methods:
                for knowledge, attacker_guess in (("whole_model", None), ("uploads_only", guess)):
                    result = invert_gradients(
                        victim, x, y, method, restore, attacker_guess, generator, noise, steps=steps, seed=index,
                        discriminator=discriminator if method == "fedcg" else None,
                        guess_discriminator=guess_discriminator if method == "fedcg" else None,
                    )
                    out[knowledge].setdefault(method, []).append(round(result.psnr, 3))
    return out


def mean_std(values: list[float]) -> str:
    """``mean ± std`` of a cell, or "not run"."""
    if not values:
        return "not run"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {std:.2f}"


def probe_section(probes: dict[str, Any]) -> list[str]:
    """The tables of ``fedmdcg_kd_probe.py`` (what the server KD does to the shared classifier)."""
    lines = [
        "## What the server distillation does to the shared classifier (diagnostic)",
        "",
        "`python reproductions/fedmdcg_kd_probe.py ...` (`docs/results/fedmdcg_kd_probe.json`): "
        "the benchmark cell re-run "
        "with a probe that, after each round, puts every client's uploaded-round extractor F_i in front of (a) its own "
        "D_i, (b) the example-weighted average D of the uploads (what AVE_agg sends) and (c) the distilled D (what "
        "KDC_agg / KD_agg send), scored on the 1,000 test digits and averaged over clients; *teachers* is the "
        "tau-weighted accuracy of D_i(G_i(z, y)) on labels drawn from p(y) (the consistency of the paper's Fig. 5).",
        "",
    ]
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
    return lines

def write_report(results: dict[str, Any]) -> None:
    """docs/results/fedmdcg_privacy.md from the attack's numbers and the probe's json."""
    settings = results["settings"]
    privacy = results["privacy"]
    lines = [
        f"# {TITLE}",
        "",
        "Generated by `python reproductions/fedmdcg_privacy.py --seeds "
        + " ".join(map(str, settings["seeds"]))
        + f" --attack_images {settings['attack_images']} --attack_steps {settings['attack_steps']}` "
        "(not a federated run, so not a `fedhet bench` grid; the comparison's Tables 1 and 3 are on "
        "[fedmdcg_mnist.md](fedmdcg_mnist.md), `fedhet bench --grid configs/grids/fedmdcg_mnist.yaml`).",
        "",
    ]
    rerun = results.get("rerun")
    if rerun:
        lines += [
            f"The rows of {', '.join(rerun['methods'])} and the reference rows were rerun with the same settings "
            f"and `--methods {' '.join(rerun['methods'])}` ({rerun['wall_s']:.0f} s); the other rows are "
            "the full run's.",
            "",
        ]
    lines += [
        "## Table 2 layout: PSNR (dB) of the gradient-inversion attack",
        "",
        f"Inverting gradients (cosine matching + TV 1e-2, Adam lr 0.1, {settings['attack_steps']} steps) on "
        f"{settings['attack_images']} training digits per seed, one image per attack, on DLG's sigmoid LeNet "
        "(the network FedMD-CG's code uses for this table), attacking the gradient of what each method uploads "
        "after one step on the image. *Whole model*: the attacker holds the victim's full model (DLG's "
        "assumption; methods differ only in which gradients they reveal). *Uploads only*: the parameters "
        "that never leave the client are replaced by the attacker's own initialisation. Higher = more leakage.",
        "",
        "| method | PSNR, whole model | PSNR, uploads only |",
        "|---|---|---|",
    ]
    for method, label in LABELS.items():
        lines.append(
            f"| {label} | {mean_std(privacy['whole_model'].get(method, []))} | "
            f"{mean_std(privacy['uploads_only'].get(method, []))} |"
        )
    lines += [
        "",
        "The reference rows use no gradient: an all-black image, the per-pixel mean of the training "
        "digits, and the random image the attack starts from, scored by the same PSNR on the same "
        "digits. A method leaks only as far as it lies above them. FedCG's row attacks FedCG's own "
        "upload: its classifier's CE gradient and its generator's adversarial gradient after the latent "
        "discriminator's step on F_i(x) (modelled as an SGD step of FedCG's Adam learning rate; "
        "`fedhet.privacy.fedcg_generator_gradients`); with *uploads only* the attacker also lacks the "
        "discriminator, which never leaves the client.",
        "",
        "## Claims of the paper, checked",
        "",
        "Each claim compares two rows' PSNR (whole model, DLG's assumption) on the same attacked digits: the "
        "paired unit is one digit (seed x image, "
        f"{len(settings['seeds']) * settings['attack_images']} pairs), the column *per seed* lists the per-digit "
        "differences, and the verdict is computed from the 95 % t interval of the mean difference "
        "(`fedhet.statistics.paired_difference`, as on every grid page). The paper's \"same level of privacy as "
        "FedCG\" is an equivalence, which a difference test cannot confirm; the paired differences between the "
        "decoupled methods follow the claims as a diagnostic.",
        "",
        claims_markdown(results["claims"], LABELS),
        "",
        "| difference (whole model) | mean, 95 % interval | per digit |",
        "|---|---|---|",
    ]
    for better, than in (("fedmdcg", "lg_fedavg"), ("fedmdcg", "fedcg")):
        d = paired_difference(*(dict(enumerate(privacy["whole_model"][row])) for row in (better, than)))
        lines.append(f"| {LABELS[better]} minus {LABELS[than]} | {d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}] | "
                     + ", ".join(f"{x:+.2f}" for x in d.differences) + " |")
    lines.append("")
    probe_path = OUT / "fedmdcg_kd_probe.json"
    if probe_path.exists():
        lines += probe_section(json.loads(probe_path.read_text()))
    atomic_write_text(OUT / f"{NAME}.md", "\n".join(lines))


def main() -> None:
    """Run the attack (unless --report_only), then write the page."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--attack_images", type=int, default=2)
    parser.add_argument("--attack_steps", type=int, default=500)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--report_only", action="store_true")
    args = parser.parse_args()
    path = OUT / f"{NAME}.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if not args.report_only:
        torch.set_num_threads(1)
        settings = {"seeds": args.seeds, "attack_images": args.attack_images, "attack_steps": args.attack_steps}
        partial = set(args.methods) != set(METHODS)
        if partial and results.get("settings") != settings:
            raise SystemExit(
                f"--methods reruns some rows into {path}, whose settings differ ({results.get('settings')}); "
                "rerun every method or pass the same --seeds, --attack_images and --attack_steps"
            )
        started = time.perf_counter()
        cells = privacy_cells(args.seeds, args.attack_images, args.attack_steps, tuple(args.methods))
        if partial:  # keep the other rows, replace the rerun ones and the references
            for knowledge, rows in cells.items():
                results["privacy"][knowledge].update(rows)
            results["rerun"] = {"methods": args.methods, "wall_s": round(time.perf_counter() - started, 1)}
        else:
            results = {"settings": settings, "privacy": cells}
            results["privacy_wall_s"] = round(time.perf_counter() - started, 1)
        atomic_write_text(path, json.dumps(results, indent=1))
    if not results:
        raise SystemExit(f"{path} does not exist; run without --report_only")
    # what `fedhet bench --claims ... docs/results/fedmdcg_privacy.json` reads into claims.md
    results.update(title=TITLE, names=LABELS, claims=claim_results(results["privacy"]["whole_model"]))
    atomic_write_text(path, json.dumps(results, indent=1))
    write_report(results)
    print(f"wrote {OUT / NAME}.md", flush=True)


if __name__ == "__main__":
    main()
