"""Mutation score of the seed methods' tests: how many one-line bugs do the oracle and unit tests catch?

Each mutant below is one plausible one-line bug in a seed method (a sign flip, swapped
arguments, a dropped weight or term, a train/eval swap, a missing detach or reset). For each,
the script copies ``fedhet/`` and ``tests/`` into a temporary directory (the other top-level
entries are linked), applies the mutant there (the original text must occur exactly once, so a
mutant that no longer matches the source fails loudly instead of counting as killed), and runs
that method's oracle and unit test files (``-x``, slow end-to-end tests excluded) on one thread.
A non-zero exit kills the mutant; a pass means it survived. The working tree is never modified.

Usage (results accumulate in ``--out``, so the mutants can be run in chunks)::

    python benchmarks/mutation_score.py --list
    python benchmarks/mutation_score.py --methods fedktl fccl_plus --out /tmp/mutation.json
    python benchmarks/mutation_score.py --report --out /tmp/mutation.json   # the markdown table

``--baseline`` first runs each method's files unmutated (they must pass, or no mutant result
means anything). The score of a method is killed / (killed + survived).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mutmut_score import own_tests

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("fedhet", "tests")


@dataclass(frozen=True)
class Mutant:
    """One one-line change: ``old`` (exactly once in ``path``) becomes ``new``."""

    method: str
    path: str
    old: str
    new: str
    kind: str

    @property
    def key(self) -> str:
        return f"{self.method}:{self.path}:{self.old.strip()[:60]}"


#: Each seed method's own tests, as the tool-generated score finds them (mutmut_score.own_tests: the files
#: named after the method file and the ones listed as testing it under another name).
TESTS = {method: own_tests(f"fedhet/algorithms/{method}.py")
         for method in ("fccl_plus", "fedktl", "fedvtc", "fedftg", "fedmdcg")}  # fmt: skip
#: The seed methods, whose score docs/mutation_score.md reports.
SEEDS = tuple(TESTS)
#: The other oracles' spot checks: one or two mutants each, run against the oracle file alone
#: (does the oracle catch a bug by itself?).
ORACLE_ONLY = {
    "fccl": "tests/algorithms/test_oracle_fccl_plus.py",
    "fedper": "tests/algorithms/test_oracle_partial.py",
    "lg_fedavg": "tests/algorithms/test_oracle_partial.py",
    "fedbn": "tests/algorithms/test_oracle_partial.py",
    "fedrs": "tests/algorithms/test_oracle_partial.py",
    "ditto": "tests/algorithms/test_oracle_partial.py",
    "fml": "tests/algorithms/test_oracle_partial.py",
    "fedproto": "tests/algorithms/test_oracle_prototypes.py",
    "fd": "tests/algorithms/test_oracle_prototypes.py",
    "fedproc": "tests/algorithms/test_oracle_prototypes.py",
    "fedgh": "tests/algorithms/test_oracle_prototypes.py",
    "fedmd": "tests/algorithms/test_oracle_distillation.py",
    "feddf": "tests/algorithms/test_oracle_distillation.py",
    "rhfl": "tests/algorithms/test_oracle_distillation.py",
    "fedmatch": "tests/algorithms/test_oracle_distillation.py",
    "fedtgp": "tests/algorithms/test_oracle_prototypes.py",
    "ccvr": "tests/algorithms/test_oracle_partial.py",
}
TESTS.update({method: [path] for method, path in ORACLE_ONLY.items()})

FCCLP, XCORR, FCCL_F = (
    "fedhet/algorithms/fccl_plus.py",
    "fedhet/algorithms/shared/cross_correlation.py",
    "fedhet/functional/fccl.py",
)
KTL, ETF = "fedhet/algorithms/fedktl.py", "fedhet/functional/etf.py"
VTC, VTC_F = "fedhet/algorithms/fedvtc.py", "fedhet/functional/vtc.py"
FTG, MDCG = "fedhet/algorithms/fedftg.py", "fedhet/algorithms/fedmdcg.py"

MUTANTS = [
    # ---------------------------------------------------------------- FCCL+
    Mutant("fccl_plus", FCCLP, "loss = loss + fntd_loss(", "loss = loss - fntd_loss(", "sign flip (FNTD)"),
    Mutant(
        "fccl_plus",
        FCCLP,
        "fntd_loss(logits, self.teacher_logits(x), y,",
        "fntd_loss(self.teacher_logits(x), logits, y,",
        "swapped arguments (student/teacher)",
    ),
    Mutant(
        "fccl_plus",
        XCORR,
        "loss = loss + fisl_weight * fisl_loss(",
        "loss = loss + fisl_loss(",
        "dropped weight (omega of FISL)",
    ),
    Mutant(
        "fccl_plus",
        XCORR,
        "optimizers[i].optimizer.state.clear()",
        "pass",
        "optimizer mode (per-round Adam instead of fresh each step)",
    ),
    Mutant(
        "fccl_plus",
        FCCL_F,
        "return (logits - logits.mean(0)) / (logits.std(0) + eps)",
        "return (logits - logits.mean(0)) / (logits.std(0, unbiased=False) + eps)",
        "biased std (FCCM)",
    ),
    Mutant(
        "fccl_plus",
        FCCL_F,
        "return on_diag + off_diag_weight * off_diag",
        "return on_diag - off_diag_weight * off_diag",
        "sign flip (FCCM off-diagonal)",
    ),
    Mutant(
        "fccl_plus",
        FCCL_F,
        "teacher_logits = teacher_logits.detach() / temperature",
        "teacher_logits = teacher_logits.detach()",
        "dropped term (teacher temperature in FNTD)",
    ),
    Mutant(
        "fccl_plus",
        "fedhet/algorithms/shared/common.py",
        "self.previous_model.train(self.hp.teacher_train_mode)",
        "self.previous_model.train(not self.hp.teacher_train_mode)",
        "train/eval swap (teacher)",
    ),
    # ---------------------------------------------------------------- FedKTL
    Mutant(
        "fedktl",
        KTL,
        "loss = loss + self.hp.mu * F.mse_loss(predicted, latents)",
        "loss = loss + F.mse_loss(predicted, latents)",
        "dropped weight (mu of L^M)",
    ),
    Mutant(
        "fedktl",
        KTL,
        '"loss": mmd + self.hp.centroid_weight * mse',
        '"loss": mmd - self.hp.centroid_weight * mse',
        "sign flip (server MSE)",
    ),
    Mutant(
        "fedktl",
        KTL,
        "        self.transformer.eval()\n        mapped = self.transformer(self.prototypes",
        "        self.transformer.train()\n        mapped = self.transformer(self.prototypes",
        "train/eval swap (centroid means)",
    ),
    Mutant(
        "fedktl",
        KTL,
        "    def on_train_start(self) -> None:\n        self.reset_latent_head()",
        "    def on_train_start(self) -> None:\n        pass",
        "dropped reset (h'_i persisted)",
    ),
    Mutant(
        "fedktl",
        KTL,
        "nn.utils.clip_grad_norm_(self.model.parameters(), self.hp.grad_clip_norm)",
        "pass",
        "dropped term (client gradient clipping)",
    ),
    Mutant(
        "fedktl",
        ETF,
        "target = cos_y * math.cos(margin) - sin_y * math.sin(margin)",
        "target = cos_y * math.cos(margin) + sin_y * math.sin(margin)",
        "sign flip (ArcFace margin)",
    ),
    Mutant(
        "fedktl",
        ETF,
        "return F.normalize(means, dim=1), counts",
        "return means, counts",
        "dropped term (prototype re-normalisation)",
    ),
    Mutant(
        "fedktl",
        ETF,
        "- 2.0 * kernel[:n, n:].mean()",
        "- kernel[:n, n:].mean()",
        "wrong weight (MMD cross term)",
    ),
    # ---------------------------------------------------------------- FedVTC
    Mutant(
        "fedvtc",
        VTC,
        "per_sample = rc + self.current_kl_weight() * kl",
        "per_sample = rc - self.current_kl_weight() * kl",
        "sign flip (KL)",
    ),
    Mutant(
        "fedvtc",
        VTC,
        "per_sample = per_sample + self.hp.dm_weight * dm",
        "per_sample = per_sample + dm",
        "dropped weight (lambda of L_dm)",
    ),
    Mutant(
        "fedvtc",
        VTC,
        "return 0.0 if self.round_idx < self.hp.kl_warmup_rounds else self.hp.kl_weight",
        "return 0.0 if self.round_idx <= self.hp.kl_warmup_rounds else self.hp.kl_weight",
        "off by one (KL warm-up)",
    ),
    Mutant(
        "fedvtc",
        VTC,
        "vtc_tc = self.vtc_loss(x, y, z_fresh)",
        "vtc_tc = self.vtc_loss(x, y, z_fresh, with_dm=False)",
        "dropped term (L_dm in the VTC step)",
    ),
    Mutant(
        "fedvtc",
        VTC_F,
        "return z + log_sigma.exp() * noise",
        "return z + log_sigma * noise",
        "dropped term (exp of log sigma)",
    ),
    Mutant(
        "fedvtc",
        VTC_F,
        "kl = 0.5 * ((z - prior_mean).pow(2).sum(1) / prior_sd**2 + variance_term)",
        "kl = 0.5 * ((z - prior_mean).pow(2).sum(1) + variance_term)",
        "dropped term (prior variance)",
    ),
    Mutant(
        "fedvtc",
        VTC_F,
        "return (sums / counts.to(values.dtype)).sum()",
        "return (sums / counts.to(values.dtype)).mean()",
        "wrong reduction (class mean sum)",
    ),
    # ---------------------------------------------------------------- FedFTG
    Mutant("fedftg", FTG, "loss = loss - discrepancy", "loss = loss + discrepancy", "sign flip (hard-sample mining)"),
    Mutant(
        "fedftg", FTG, "decay = self.hp.lr_decay**self.round_idx", "decay = 1.0", "dropped term (learning-rate decay)"
    ),
    Mutant(
        "fedftg",
        FTG,
        "share = len(teachers) / self.active_teachers",
        "share = 1.0",
        "wrong weight (diversity share per teacher)",
    ),
    Mutant(
        "fedftg",
        FTG,
        "self.student.eval().requires_grad_(False)",
        "self.student.train().requires_grad_(False)",
        "train/eval swap (global model while the generator steps)",
    ),
    Mutant(
        "fedftg",
        FTG,
        "        self.generator.eval()\n        self.student.train()",
        "        self.generator.train()\n        self.student.train()",
        "train/eval swap (generator during transfer)",
    ),
    Mutant(
        "fedftg",
        FTG,
        "lr=self.hp.student_lr * decay, weight_decay=self.hp.student_weight_decay",
        "lr=self.hp.student_lr * decay",
        "dropped term (global model weight decay)",
    ),
    # ---------------------------------------------------------------- FedMD-CG
    Mutant(
        "fedmdcg",
        MDCG,
        "loss = loss + ramp * hp.lambda_feature_mse * F.mse_loss(features, generated)",
        "loss = loss - ramp * hp.lambda_feature_mse * F.mse_loss(features, generated)",
        "sign flip (feature MSE)",
    ),
    Mutant(
        "fedmdcg",
        MDCG,
        "target = self.model.forward_head(generated).detach()",
        "target = self.model.forward_head(generated)",
        "missing detach (logit KL target)",
    ),
    Mutant(
        "fedmdcg",
        MDCG,
        "kl = distillation_kl_loss(logits, target, hp.client_temperature, hp.kl_direction)",
        "kl = distillation_kl_loss(target, logits, hp.client_temperature, hp.kl_direction)",
        "swapped KL arguments (client)",
    ),
    Mutant(
        "fedmdcg",
        MDCG,
        "        self.model.eval()\n        self.generator.train()",
        "        self.model.train()\n        self.generator.train()",
        "train/eval swap (classifier during the generator step)",
    ),
    Mutant(
        "fedmdcg",
        MDCG,
        "+ hp.lambda_generator_ce * ce",
        "- hp.lambda_generator_ce * ce",
        "sign flip (generator CE)",
    ),
    Mutant(
        "fedmdcg",
        MDCG,
        "mse = F.mse_loss(generated, features)",
        "mse = 0.5 * F.mse_loss(generated, features)",
        "wrong weight (generator MSE)",
    ),
]


COMMON = "fedhet/algorithms/shared/common.py"
MUTANTS += [
    # ---------------------------------------------------------------- other oracles (spot checks)
    Mutant(
        "fccl",
        "fedhet/algorithms/fccl.py",
        "dual_domain_distillation(logits, self.teacher_logits(x), pretrained_logits)",
        "dual_domain_distillation(logits, pretrained_logits, pretrained_logits)",
        "wrong teacher (pre-trained model twice)",
    ),
    Mutant(
        "fedper",
        "fedhet/algorithms/fedper.py",
        "return {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIX)}",
        "return {k: v for k, v in state.items() if k.startswith(HEAD_PREFIX)}",
        "wrong part shared (the head instead of the base)",
    ),
    Mutant(
        "lg_fedavg",
        "fedhet/algorithms/lg_fedavg.py",
        '"samples", per_architecture=False, send_initial=False',
        '"uniform", per_architecture=False, send_initial=False',
        "wrong weight (uniform instead of example-weighted average)",
    ),
    Mutant(
        "fedbn",
        "fedhet/algorithms/fedbn.py",
        "        local = batch_norm_state_keys(self.model)\n",
        "        local = set()\n",
        "dropped term (BatchNorm uploaded)",
    ),
    Mutant(
        "fedrs",
        "fedhet/functional/contrastive.py",
        "torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, alpha))",
        "torch.where(counts > 0, torch.full_like(counts, alpha), torch.ones_like(counts))",
        "swapped arguments (damps the held classes)",
    ),
    Mutant(
        "ditto",
        "fedhet/algorithms/ditto.py",
        "loss = loss + self.hp.lam / 2 * proximal_term(",
        "loss = loss + self.hp.lam * proximal_term(",
        "wrong weight (lam instead of lam / 2)",
    ),
    Mutant(
        "fml",
        "fedhet/functional/mutual_learning.py",
        "(1 - beta) * distillation_kl(logits_b, logits_a, reduction)",
        "(1 - beta) * distillation_kl(logits_a, logits_b, reduction)",
        "swapped KL arguments (meme's term)",
    ),
    Mutant(
        "fedproto",
        COMMON,
        "loss = loss + self.regulariser_weight() * self.regulariser(statistic[known], means[y[known]])",
        "loss = loss - self.regulariser_weight() * self.regulariser(statistic[known], means[y[known]])",
        "sign flip (prototype regulariser)",
    ),
    Mutant(
        "fd",
        "fedhet/functional/distillation.py",
        "target = F.softmax(target_logits.detach(), dim=1)",
        "target = F.softmax(target_logits.detach() / 2.0, dim=1)",
        "wrong temperature (FD's cross-entropy target)",
    ),
    Mutant(
        "fedproc",
        "fedhet/algorithms/fedproc.py",
        "return weight * proto + (1.0 - weight) * ce",
        "return weight * ce + (1.0 - weight) * proto",
        "swapped weights (alpha_t on CE)",
    ),
    Mutant(
        "fedgh",
        "fedhet/algorithms/fedgh.py",
        "            copy_state_into(self.model.head, download.weights)",
        "            pass",
        "dropped term (global head not taken)",
    ),
    Mutant(
        "fedmd",
        "fedhet/algorithms/fedmd.py",
        "return [digest_loss(z, consensus, self.hp.digest_loss) for z in logits]",
        'return [digest_loss(z, consensus, "mse") for z in logits]',
        "wrong loss (MSE whatever digest_loss says)",
    ),
    Mutant(
        "feddf",
        "fedhet/functional/distillation.py",
        "return temperature**2 * kl_to_target(student_logits / temperature, target)",
        "return kl_to_target(student_logits / temperature, target)",
        "dropped weight (T^2)",
    ),
    Mutant(
        "rhfl",
        "fedhet/algorithms/rhfl.py",
        "weighted_peer_kl(student, [logits[j] for j in peers], confidences[peers])",
        "weighted_peer_kl(student, [logits[j] for j in peers], confidences[[i] * len(peers)])",
        "wrong weight (own confidence for every peer)",
    ),
    Mutant(
        "fedmatch",
        "fedhet/algorithms/fedmatch.py",
        "helpers = (probs.sum(dim=0) - probs[i]) / (len(logits) - 1)",
        "helpers = probs.sum(dim=0) / len(logits)",
        "wrong term (own vote among the helpers)",
    ),
    Mutant(
        "fedtgp",
        "fedhet/functional/prototype_learning.py",
        "handicap = F.one_hot(labels, global_prototypes.shape[0]).to(distances.dtype) * margin",
        "handicap = F.one_hot(labels, global_prototypes.shape[0]).to(distances.dtype) * 0.0",
        "dropped term (adaptive margin)",
    ),
    Mutant(
        "ccvr",
        "fedhet/algorithms/ccvr.py",
        "features.append((self.global_means[c].double() + noise @ factor.T).float())",
        "features.append((self.global_means[c].double() + noise @ factor).float())",
        "transposed factor (L instead of L^T)",
    ),
]


def sandbox() -> Path:
    """A temporary tree: ``fedhet/`` and ``tests/`` copied (no caches), everything else linked."""
    where = Path(tempfile.mkdtemp(prefix="fedhet-mutant-"))
    for entry in ROOT.iterdir():
        if entry.name in COPIED:
            shutil.copytree(entry, where / entry.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif entry.name != ".git":
            (where / entry.name).symlink_to(entry)
    return where


def apply(tree: Path, mutant: Mutant) -> None:
    """Write the mutant into ``tree`` (the original text must occur exactly once)."""
    path = tree / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(
            f"mutant {mutant.key!r}: its text occurs {count} times in {mutant.path}, expected once; "
            "update the mutant to the current source"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


def run_tests(tree: Path, method: str, timeout: float) -> tuple[str, float, str]:
    """``(outcome, seconds, last line)`` of the method's test files in ``tree``: passed, failed or timeout."""
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *TESTS[method]]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start, ""
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]  # which test caught it
    last = (failed[0] + " | " if failed else "") + (lines[-1] if lines else "")
    return ("passed" if done.returncode == 0 else "failed"), time.perf_counter() - start, last


def load(out: Path) -> dict:
    """The results accumulated so far (none: an empty dict)."""
    return json.loads(out.read_text()) if out.exists() else {}


def save(out: Path, results: dict) -> None:
    """Atomic write (a chunk interrupted half-way keeps the previous results)."""
    temporary = out.with_suffix(out.suffix + ".tmp")
    temporary.write_text(json.dumps(results, indent=1, sort_keys=True))
    temporary.replace(out)


def report(results: dict) -> str:
    """The markdown table: per method, mutants killed, survived, score; then the survivors."""
    lines = ["| method | mutants | killed | survived | score |", "|---|---|---|---|---|"]
    survivors = []
    for method in SEEDS:
        rows = [r for r in results.values() if r["method"] == method and r["outcome"] != "baseline"]
        if not rows:
            continue
        killed = sum(r["outcome"] in ("failed", "timeout") for r in rows)
        survived = len(rows) - killed
        lines.append(f"| {method} | {len(rows)} | {killed} | {survived} | {killed / len(rows):.0%} |")
        survivors += [f"- {method}: {r['kind']} (`{r['path']}`)" for r in rows if r["outcome"] == "passed"]
    total = [r for r in results.values() if r["method"] in SEEDS]
    if total:
        killed = sum(r["outcome"] in ("failed", "timeout") for r in total)
        lines.append(f"| **all** | {len(total)} | {killed} | {len(total) - killed} | {killed / len(total):.0%} |")
    lines += [""] + ["Survivors:"] + survivors if survivors else []
    others = [r for r in results.values() if r["method"] not in SEEDS]
    if others:
        lines += ["", "Spot checks of the other oracles (the oracle file alone):", ""]
        lines += ["| method | mutant | outcome |", "|---|---|---|"]
        for r in sorted(others, key=lambda r: r["method"]):
            verdict = "survived" if r["outcome"] == "passed" else "killed"
            lines.append(f"| {r['method']} | {r['kind']} | {verdict} ({r['seconds']} s) |")
    return "\n".join(lines)


def main() -> None:
    """List, report, or run the chosen methods' mutants (``--baseline``: their unmutated tests first)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="*", default=list(SEEDS), choices=list(TESTS))
    parser.add_argument("--out", type=Path, default=Path("mutation_score.json"), help="results (JSON, accumulated)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per test run (past it: killed)")
    parser.add_argument("--baseline", action="store_true", help="first run each method's files unmutated")
    parser.add_argument("--skip-done", action="store_true", help="skip mutants already in --out")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--report", action="store_true", help="print the table of --out and exit")
    args = parser.parse_args()
    if args.list:
        for m in MUTANTS:
            print(f"{m.method:10s} {m.kind:55s} {m.path}")
        return
    if args.report:
        print(report(load(args.out)))
        return
    results = load(args.out)
    for method in args.methods:
        if args.baseline:
            tree = sandbox()
            try:
                outcome, seconds, last = run_tests(tree, method, args.timeout)
            finally:
                shutil.rmtree(tree)
            print(f"{method:10s} baseline {outcome} in {seconds:.1f} s: {last}", flush=True)
            if outcome != "passed":
                raise SystemExit(f"{method}: its tests fail unmutated ({last}); fix them before scoring mutants")
        for mutant in (m for m in MUTANTS if m.method == method):
            if args.skip_done and mutant.key in results:
                continue
            tree = sandbox()
            try:
                apply(tree, mutant)
                outcome, seconds, last = run_tests(tree, method, args.timeout)
            finally:
                shutil.rmtree(tree)
            verdict = "survived" if outcome == "passed" else "killed"
            print(f"{method:10s} {verdict:8s} {seconds:6.1f} s  {mutant.kind}", flush=True)
            results[mutant.key] = {
                "method": method,
                "path": mutant.path,
                "kind": mutant.kind,
                "outcome": outcome,
                "seconds": round(seconds, 1),
                "last_line": last,
            }
            save(args.out, results)


if __name__ == "__main__":
    main()
