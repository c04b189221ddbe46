"""Mutation score per file with a pinned mutation-testing tool: mutmut 3.8.1 over algorithms/ and functional/.

``benchmarks/mutation_score.py`` checks a hand-written list of plausible bugs; this script lets a
tool write the mutants, so nobody chooses which bugs the tests are asked about. For each source
file it builds a workspace in a temporary directory (copies of ``fedhet/``, ``tests/``,
``configs/`` and the project files, ``../shared`` linked beside it, so the working tree is never
touched), adds a ``[tool.mutmut]`` section that mutates **that file only** and selects **its own
tests** (``OWN_TESTS`` below: the test files named after it plus the oracle and unit files that
test it under another name; the doctests of ``fedhet/functional``), and runs ``mutmut run``.
Each mutant runs, in a process forked from a server that has imported torch but run nothing
(``process_isolation = "forkserver"``: a fork of a process whose torch thread pool is running
hangs, which mutmut would count as a timeout, i.e. a kill), the tests that cover the mutated
function. mutmut's statuses are read from its ``mutants/<file>.meta``.

Score = killed / (killed + survived - equivalent), with mutmut's timeouts counted as killed (a
mutant that makes a test run 15 times longer than clean is caught) and mutants no test reaches
("no tests") counted as survived. Surviving mutants judged equivalent (no input can tell them
apart from the original) are listed in ``EQUIVALENT`` with the reason; docs/mutation_score.md
shows the table.

Usage (results accumulate in ``--out``, one entry per file, so files can be run in chunks)::

    pip install mutmut==3.8.1
    python benchmarks/mutmut_score.py fedhet/functional/fccl.py fedhet/algorithms/fedftg.py
    python benchmarks/mutmut_score.py --all                 # every file of algorithms/ and functional/
    python benchmarks/mutmut_score.py --all --skip-done     # only files not in --out yet
    python benchmarks/mutmut_score.py --report              # the markdown table of --out
    python benchmarks/mutmut_score.py --survivors fedhet/functional/fccl.py   # their diffs
    python benchmarks/mutmut_score.py fedhet/algorithms/fedktl.py --minutes 50 --resume   # in chunks

A file too slow for one sitting (``fedktl.py``: about 100 minutes) runs in chunks: ``--minutes``
stops mutmut after that long and keeps its workspace under ``--workspace`` (default
``runs/mutmut``, kept between sessions on one machine) instead of deleting it, and ``--resume``
goes on in that workspace, where mutmut skips the mutants it has decided. A workspace is reused only
while the source file and the tests it runs (its own test files and the shared test helpers) are
byte for byte those it started with; any change there starts the file again, so every verdict of
a recorded score comes from the same source and the same tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTMUT_VERSION = "3.8.1"
MUTATED = ("fedhet/algorithms", "fedhet/functional")
COPIED = ("fedhet", "tests", "configs", "pyproject.toml", "setup.cfg")
DOCTESTS = "tests/test_functional_doctests.py"
#: A fresh-interpreter recheck running longer than this counts as a timeout (killed), as in mutmut.
FRESH_TIMEOUT_S = 900.0
#: The goals of the oracle-tests issue: 90 % in the seed methods' files, the contract's files and
#: functional/, 80 % elsewhere in algorithms/.
SEED_FILES = ("fedftg.py", "fedmdcg.py", "fedvtc.py", "fccl_plus.py", "fedktl.py", "common.py", "base.py")

#: Test files that test a source file under another name than ``test_<stem>.py`` /
#: ``test_oracle_<stem>.py`` (those are found by name).
EXTRA_TESTS = {
    "fedhet/functional/aggregation.py": ["tests/functional/test_robust_aggregation.py"],
    "fedhet/functional/prototypes.py": ["tests/functional/test_aggregation.py"],
    "fedhet/functional/regularizers.py": ["tests/functional/test_aggregation.py"],
    "fedhet/functional/guidance.py": ["tests/functional/test_matryoshka_guidance.py"],
    "fedhet/functional/matryoshka.py": ["tests/functional/test_matryoshka_guidance.py"],
    "fedhet/algorithms/base.py": ["tests/algorithms/test_contract.py", "tests/algorithms/test_hparams.py",
                                  "tests/algorithms/test_oracle_fedavg_family.py",
                                  "tests/federation/test_contract_v2.py", "tests/federation/test_lr_schedule.py"],
    # the shared parts' own tests (test_common.py) and those of the methods built from them
    "fedhet/algorithms/shared/common.py": ["tests/algorithms/test_oracle_partial.py",
                                           "tests/algorithms/test_oracle_distillation.py",
                                           "tests/algorithms/test_oracle_prototypes.py",
                                           "tests/algorithms/test_oracle_fccl_plus.py",
                                           "tests/algorithms/test_oracle_fedavg_family.py",
                                           *(f"tests/algorithms/test_{name}.py" for name in (
                                               "fedavg", "fedproto", "feddyn", "scaffold", "moon", "fedmd",
                                               "lockstep_drop", "fml", "fedkd"))],
    "fedhet/algorithms/shared/cross_correlation.py": ["tests/algorithms/test_oracle_fccl_plus.py",
                                                      "tests/algorithms/test_fccl_plus.py"],
    "fedhet/algorithms/shared/generators.py": ["tests/algorithms/test_oracle_fedmdcg.py",
                                               "tests/algorithms/test_oracle_fedcg.py",
                                               "tests/algorithms/test_fedmdcg_server_knobs.py",
                                               "tests/algorithms/test_fedmdcg.py", "tests/algorithms/test_fedcg.py",
                                               "tests/algorithms/test_generator_classifier.py"],
    "fedhet/algorithms/fccl.py": ["tests/algorithms/test_oracle_fccl_plus.py"],
    "fedhet/algorithms/fedmdcg.py": ["tests/algorithms/test_fedmdcg_server_knobs.py"],
    "fedhet/algorithms/fedcg.py": ["tests/algorithms/test_fedmdcg_server_knobs.py"],
    "fedhet/algorithms/fedmrl.py": ["tests/algorithms/test_fedmrl_fedl2g.py"],
    "fedhet/algorithms/fedl2g.py": ["tests/algorithms/test_fedmrl_fedl2g.py"],
    "fedhet/algorithms/fedbn.py": ["tests/algorithms/test_fedbn_ditto.py", "tests/algorithms/test_oracle_partial.py"],
    "fedhet/algorithms/ditto.py": ["tests/algorithms/test_fedbn_ditto.py", "tests/algorithms/test_oracle_partial.py"],
    "fedhet/algorithms/fedper.py": ["tests/algorithms/test_oracle_partial.py"],
    "fedhet/algorithms/lg_fedavg.py": ["tests/algorithms/test_oracle_partial.py"],
    "fedhet/algorithms/fedrs.py": ["tests/algorithms/test_oracle_partial.py"],
    "fedhet/algorithms/fml.py": ["tests/algorithms/test_oracle_partial.py"],
    "fedhet/algorithms/ccvr.py": ["tests/algorithms/test_ccvr_fedtype.py", "tests/algorithms/test_oracle_partial.py"],
    "fedhet/algorithms/fedtype.py": ["tests/algorithms/test_ccvr_fedtype.py"],
    "fedhet/algorithms/fedmd.py": ["tests/algorithms/test_oracle_distillation.py"],
    "fedhet/algorithms/feddf.py": ["tests/algorithms/test_oracle_distillation.py"],
    "fedhet/algorithms/rhfl.py": ["tests/algorithms/test_oracle_distillation.py"],
    "fedhet/algorithms/fedmatch.py": ["tests/algorithms/test_oracle_distillation.py"],
    "fedhet/algorithms/fedproto.py": ["tests/algorithms/test_oracle_prototypes.py"],
    "fedhet/algorithms/fd.py": ["tests/algorithms/test_oracle_prototypes.py"],
    "fedhet/algorithms/fedproc.py": ["tests/algorithms/test_oracle_prototypes.py"],
    "fedhet/algorithms/fedgh.py": ["tests/algorithms/test_oracle_prototypes.py"],
    "fedhet/algorithms/fedtgp.py": ["tests/algorithms/test_oracle_prototypes.py"],
    "fedhet/algorithms/fedavg.py": ["tests/algorithms/test_oracle_fedavg_family.py"],
    "fedhet/algorithms/fedprox.py": ["tests/algorithms/test_oracle_fedavg_family.py"],
    "fedhet/algorithms/feddyn.py": ["tests/algorithms/test_oracle_fedavg_family.py"],
    "fedhet/algorithms/scaffold.py": ["tests/algorithms/test_oracle_fedavg_family.py"],
    "fedhet/algorithms/moon.py": ["tests/algorithms/test_oracle_fedavg_family.py"],
    "fedhet/algorithms/__init__.py": ["tests/algorithms/test_contract.py"],
}

#: Surviving mutants judged equivalent by a rule: (the original line -> the mutated lines the rule
#: allows, the reason). The losses of ``functional/`` and the methods take ``[B, C]`` logits and
#: ``[B, d]`` features, so a softmax's or a normalisation's ``dim=1`` is the implicit one.
def _each_occurrence(line: str, old: str, news: tuple[str, ...]) -> set[str]:
    spots = [i for i in range(len(line)) if line.startswith(old, i)]
    return {line[:i] + new + line[i + len(old):] for i in spots for new in news}


def _implicit_dim(line: str) -> set[str]:
    if "softmax(" not in line and "normalize(" not in line:
        return set()
    positional = {variant for old in re.findall(r"softmax\([\w.]+, 1\)", line)
                  for variant in _each_occurrence(line, old, (old[:-2] + "None)", old[:-2] + ")"))}  # fmt: skip
    return _each_occurrence(line, "dim=1", ("dim=None", "")) | positional


def _default_device(line: str) -> set[str]:
    keyword = {variant for old in re.findall(r"device=[\w.]+\.device", line)
               for variant in _each_occurrence(line, old, ("device=None", ""))}  # fmt: skip
    moved = {variant for old in re.findall(r"\.to\([\w.]+\.device\)", line)
             for variant in _each_occurrence(line, old, (".to(None)",))}  # fmt: skip
    return keyword | moved


def _literal(value: object) -> str:
    """``value`` as the project's code writes it (double-quoted strings)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _declared_default(line: str) -> set[str]:
    """An argument of a run-plan record (``RunPhase``, ``LocalStage``) dropped where it equals the field's default."""
    import dataclasses

    from fedhet.algorithms.base import LocalStage, RunPhase

    variants: set[str] = set()
    for record in (RunPhase, LocalStage):
        if f"{record.__name__}(" not in line:
            continue
        fields = dataclasses.fields(record)
        first = f"{record.__name__}({_literal(fields[0].default)}, "  # the first field given by position
        variants |= _each_occurrence(line, first, (f"{record.__name__}(",))
        for field in fields:
            keyword = f"{field.name}={_literal(field.default)}"
            variants |= _each_occurrence(line, keyword + ", ", ("",)) | _each_occurrence(line, keyword, ("",))
    return variants


def _unshuffled(line: str) -> set[str]:
    return _each_occurrence(line, "shuffle=False", ("shuffle=None", "")) if "DataLoader(" in line else set()


def _uniform_weights(line: str) -> set[str]:
    return _each_occurrence(line, "[1.0] *", ("[2.0] *",)) if "weighted_average(" in line else set()


CPU_ONLY = ("on a CPU-only machine the default device is the input's: equivalent here; a GPU run tells them apart "
            "(benchmarks/gpu_check.py runs every method on one)")
STRICT_IDLE = "the lengths were checked just above: zip's strict is idle"
GENERATORS = "fedhet.algorithms.shared.generators.xǁ"
RULES = (
    (_implicit_dim, "a softmax or L2 normalisation of a 2-D input without a dim uses dim 1 (torch's implicit dim "
                    "for 2-D; F.normalize's default): the same op"),
    (_default_device, CPU_ONLY),
    (_declared_default, "the dropped argument passes the record's declared default (RunPhase / LocalStage): the same"),
    (_uniform_weights, "weighted_average normalises the weights: equal weights of 2 are equal weights of 1"),
    (_unshuffled, "DataLoader's shuffle is False by default and for None"),
)
#: Other surviving mutants judged equivalent, keyed by the mutated function and the mutated line
#: (:func:`equivalence_key`: stable when mutmut renumbers), with the reason.
EQUIVALENT: dict[str, str] = {
    **{f"fedhet.algorithms.fedtgp.xǁFedTGPClientǁ{function}: {line}": reason for function, line, reason in (
        ("forward", 'if self.hp.prediction == "head" or self.global_means is None and self.global_present is None:',
         "on_receive sets global_means and global_present together (both None before a download): one test is both"),
        ("local_loss", "if self.global_means is not None or self.global_present is not None:",
         "on_receive sets global_means and global_present together (both None before a download): one test is both"),
        ("forward", "means, present = self.global_on(None)", CPU_ONLY),
        ("local_loss", "means, present = self.global_on(None)", CPU_ONLY),
        ("forward", 'return (-pairwise_distances(features, means).pow(2)).masked_fill(~present, float("-INF"))',
         "float() reads 'inf' in any case: float('-INF') is float('-inf')"))},
    "fedhet.algorithms.fedtgp.xǁFedTGPServerǁaggregate: super().aggregate(None, uploads)":
        "PrototypeTrainingServer.aggregate does not read round_idx",
    "fedhet.algorithms.fedtgp.xǁFedTGPServerǁaggregate: self.seen |= present.to(None)": CPU_ONLY,
    "fedhet.functional.fccl.x_fccm_loss: off_mask = ~torch.eye(matrix.shape[1], dtype=torch.bool, "
    "device=matrix.device)": "the cross-correlation matrix is square (C x C): shape[1] == shape[0]",
    **{f"fedhet.functional.aggregation.x_aggregate_class_means: {line}": reason for line, reason in (
        ("stacked = torch.stack([v.to(None) for v in values])  # [N, C, D]",
         "the product with the float64 coefficients promotes the values to float64 exactly: the same sums"),
        ("held = torch.stack(list(counts)).to(None)  # [N, C]",
         "int64 counts promote to float64 in the weighted sum and the division: the same values"),
        ("coefficient = held if weighting == \"count\" else (held > 0).to(None)",
         "a boolean mask promotes to float64 in the weighted sum and the division: the same values"),
        ("result = torch.where(present.unsqueeze(+1), summed / total.clamp_min(1e-12).unsqueeze(-1), "
         "torch.zeros_like(summed))", "present is 1-D: unsqueeze(1) == unsqueeze(-1)"),
        ("result = torch.where(present.unsqueeze(-1), summed / total.clamp_min(1e-12).unsqueeze(+1), "
         "torch.zeros_like(summed))", "total is 1-D: unsqueeze(1) == unsqueeze(-1)"))},
    "fedhet.functional.calibration.x_pool_class_gaussians: weights = counts.to(None)":
        "integer counts promote to the means' dtype in every product and division: the same values",
    'fedhet.functional.calibration.x_pool_class_gaussians: outer = torch.einsum("K,KI,KJ->IJ", weights, means, '
    'means)': "einsum labels renamed consistently: the same contraction",
    **{f"fedhet.functional.conditional_generators.x_class_client_weights: {line}": reason for line, reason in (
        ("return counts / counts.sum(dim=0, keepdim=False).clamp_min(1.0)",
         "a [C] row broadcasts over the [N, C] counts exactly as the kept [1, C] row"),
        ("return counts / counts.sum(dim=0, ).clamp_min(1.0)",
         "a [C] row broadcasts over the [N, C] counts exactly as the kept [1, C] row"),
        ("counts = label_counts.to(None)", "integer counts divide truly into the default float32: the same"))},
    "fedhet.functional.conditional_generators.x_ensemble_distillation_kl: per_sample = distribution_kl("
    "student_logits, teacher, temperature, )": "teacher_first is distribution_kl's default direction",
    **{f"fedhet.functional.conditional_generators.x_label_aware_diversity_loss: {line}": reason
       for line, reason in (
        ("source = torch.cat([noise, labels_onehot.to(None)], dim=1) if kind == \"div1\" else noise",
         "torch.cat promotes the integer one-hot labels to the noise's float dtype: the same"),
        ("return diff.pow(2).mean(dim=2) if (squared_mean) or True else diff.abs().mean(dim=2)",
         "the only unsquared distance is the one-hot labels', whose differences are -1, 0 or 1: d^2 = |d|"),
        ("product = product * torch.exp(distance(labels_onehot.to(flat.dtype), squared_mean=None))",
         "None is falsy, as False"),
        ("return diff.pow(2).sum(dim=2).clamp_min(1e-12).sqrt() * (1 + torch.eye(len(values), "
         "device=values.device))", "the diagonal distances are sqrt(1e-12) = 1e-6; their products (1e-12) "
         "vanish next to float32's resolution of the mean"))},
    **{f"fedhet.functional.contrastive.x_model_contrastive_loss: {side} = F.cosine_similarity(features, "
       f"{other}_features, {dim})": "cosine similarity of [B, d] features: dim 1, dim -1 and the default are one"
       for side, other in (("positive", "global"), ("negative", "previous")) for dim in ("", "dim=+1")},
    'fedhet.functional.contrastive.x_prototypical_contrastive_loss: similarity = similarity.masked_fill('
    '~available.unsqueeze(0), float("-INF"))': 'float("-INF") == float("-inf")',
    'fedhet.functional.data_free.x_ensemble_probabilities: return torch.einsum("KBM,BK->BM", '
    'F.softmax(teacher_logits, dim=2), sample_weights)': "einsum labels renamed consistently: the same contraction",
    "fedhet.functional.data_free.x_label_sampling_distribution: num_classes = counts.shape[+1]":
        "the counts are [K, M]: shape[1] is shape[-1]",
    **{f"fedhet.functional.distillation.x_client_confidence_weights: amount = {line}":
       "a constant added to every a_i cancels in the softmax (the docstring says so)"
       for line in ("1.0 * (previous.numel() - 1) + beta * share", "2.0 / (previous.numel() - 1) + beta * share",
                    "1.0 / (previous.numel() + 1) + beta * share")},
    **{f"fedhet.functional.distillation.x_client_confidence_weights: {line}": "the other loss vector is "
       "float64, so the difference promotes this one exactly: the same values"
       for line in ("previous = previous_losses.to(None)", "current = current_losses.to(None)")},
    "fedhet.functional.distillation.x_client_confidence_weights: share = quality / total if bool(total.abs() >= "
    "1e-12) else torch.zeros_like(quality)": "the guard's boundary: differs only when |sum q| is exactly 1e-12",
    "fedhet.functional.distillation.x_masked_pseudo_label_loss: return (per_sample * mask.to(None)).sum() / "
    "max(logits.shape[0], 1)": "a boolean mask promotes to the loss's dtype in the product: the same",
    **{f"fedhet.functional.distillation.x_symmetric_cross_entropy: {line}":
       "softmax outputs and one-hot labels never exceed 1: the upper clamp is idle"
       for line in ("probs = F.softmax(logits, dim=1).clamp(min=1e-7, max=None)",
                    "probs = F.softmax(logits, dim=1).clamp(min=1e-7, )",
                    "probs = F.softmax(logits, dim=1).clamp(min=1e-7, max=2.0)",
                    "one_hot = F.one_hot(labels, logits.shape[1]).to(probs.dtype).clamp(min=label_clamp, max=None)",
                    "one_hot = F.one_hot(labels, logits.shape[1]).to(probs.dtype).clamp(min=label_clamp, )",
                    "one_hot = F.one_hot(labels, logits.shape[1]).to(probs.dtype).clamp(min=label_clamp, max=2.0)")},
    "fedhet.functional.distillation.x_symmetric_cross_entropy: one_hot = F.one_hot(labels, logits.shape[1])"
    ".to(None).clamp(min=label_clamp, max=1.0)": "a float clamp bound promotes the integer one-hot to float",
    **{f"fedhet.functional.distillation.x_weighted_peer_kl: weights = {line}": CPU_ONLY for line in (
        "peer_weights.to(None, student_logits.dtype)", "peer_weights.to(student_logits.dtype)")},
    **{f"fedhet.functional.etf.x_{function}: {line}": "mode='reduced' is torch.linalg.qr's default"
       for function, line in (("_orthonormal_columns", "q, _ = torch.linalg.qr(random, )"),
                              ("simplex_etf", "basis, _ = torch.linalg.qr(centering[:, : c - 1], )"))},
    **{f"fedhet.functional.etf.x_simplex_etf: centering = torch.eye(c, {dtype}) - torch.full((c, c), 1.0 / c, "
       "dtype=torch.float64)": "the identity's 0 and 1 are exact in float32 and promote to float64 in the "
       "difference: the same matrix" for dtype in ("dtype=None", "")},
    "fedhet.functional.etf.x_rbf_mmd2: joint = torch.cat([x, y], )": "dim=0 is torch.cat's default",
    **{"fedhet.functional.matryoshka.x_matryoshka_loss: return torch.stack([w * F.cross_entropy(z, targets) for "
       f"z, w in zip(logits, weights, {strict})]).sum()": STRICT_IDLE
       for strict in ("strict=None", "", "strict=False")},
    "fedhet.functional.matryoshka.x_nested_prefixes: width = representation.shape[+1]":
        "the representation is [B, d] (it is sliced [:, :d]): shape[1] is shape[-1]",
    **{f"fedhet.functional.mutual_learning.x_compress_state: {line}": reason for line, reason in (
        ("if tensor.is_floating_point() or tensor.dim() >= 2 and tensor.shape[0] > 1:",
         "a floating tensor of one dimension becomes a [n, 1] matrix, whose factors (k * (n + 2)) are never fewer"),
        ("if tensor.is_floating_point() and tensor.dim() >= 2 and tensor.shape[1] > 1:",
         "a matrix with one row or one column never passes the size test k * (m + n + 1) < m * n"),
        ("if tensor.is_floating_point() and tensor.dim() >= 2 and tensor.shape[0] >= 1:",
         "a matrix with one row never passes the size test k * (1 + n + 1) < n"))},
    **{f"fedhet.functional.mutual_learning.x_svd_compress: {line}": "the top-k singular vectors of the full "
       "decomposition are those of the reduced one (the same LAPACK call); only they are kept"
       for line in ("u, s, vh = torch.linalg.svd(matrix, full_matrices=True)",
                    "u, s, vh = torch.linalg.svd(matrix, )")},
    "fedhet.functional.prototype_learning.x_adaptive_margin: distances.fill_diagonal_(float(\"INF\"))":
        'float("INF") == float("inf")',
    "fedhet.functional.prototype_learning.x_margin_contrastive_loss: handicap = F.one_hot(labels, "
    "global_prototypes.shape[0]).to(None) * margin": "the integer one-hot promotes to float in the product with "
    "the margin and the sum with the distances: the same values",
    "fedhet.functional.prototype_learning.x_prototype_alignment_loss: return (features - targets).pow(2)"
    ".sum(+1).clamp_min(_SQRT_EPS).sqrt().mean()": "the features are [B, K]: dim 1 is dim -1",
    **{"fedhet.functional.prototype_learning.x_prototype_examples: for client_values, client_counts in "
       f"zip(values, counts, {strict}):": STRICT_IDLE
       for strict in ("", "strict=True", "strict=None")},
    "fedhet.functional.prototype_learning.x_prototype_examples: labels.append(held.to(None))":
        "torch.nonzero already returns int64 indices",
    "fedhet.functional.prototypes.x_class_means: means = sums / counts.clamp_min(1).unsqueeze(1).to(None)":
        "the integer counts promote to the sums' float dtype in the division: the same values",
    'fedhet.functional.vtc.x_prototype_geometry: distances.fill_diagonal_(float("INF"))':
        'float("INF") == float("inf")',
    "fedhet.functional.vtc.x_class_mean_sum: return (sums / counts.to(None)).sum()":
        "the integer counts promote to the sums' float dtype in the division: the same values",
    "fedhet.functional.aggregation.x_krum_scores: scores[i] = others.sort().values[:closest].sum() if "
    "(others.numel()) or True else 0.0": "the sum of an empty selection is 0.0, the else branch's value",
    **{f"fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁ__init__: {line}": "a placeholder that begin_round sets "
       "before anything reads it (the loop begins every round before it refines, logs or checkpoints the stage)"
       for line in ("self.round_idx = None", "self.round_idx = 1", 'self.group = None', 'self.group = "XXXX"',
                    "self.active_teachers = None", "self.active_teachers = 1",
                    "self.alpha = None  # [K, M] class-level ensemble weights of the round",
                    "self.alpha = torch.zeros(1)  # [K, M] class-level ensemble weights of the round",
                    "self.label_probs = None  # [M] p_t(y)", "self.label_probs = torch.zeros(1)  # [M] p_t(y)",
                    "self.sums: dict[str, float] = None  # round totals of the logged terms",
                    "self.counts: dict[str, int] = None")},
    "fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁ__init__: self.automatic_optimization = None":
        "Lightning reads automatic_optimization as a truth value: None is False",
    **{f"fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁattach: {line}": "a seed stream's label only names it: any "
       "fixed label gives an equally valid fixed initialisation (the run seed's part is tested)"
       for line in ('with seeded(derive_seed(context.seed, None, "generator")):',
                    'with seeded(derive_seed(context.seed, "fedftg", None)):',
                    'with seeded(derive_seed(context.seed, "generator")):',
                    'with seeded(derive_seed(context.seed, "fedftg", )):',
                    'with seeded(derive_seed(context.seed, "XXfedftgXX", "generator")):',
                    'with seeded(derive_seed(context.seed, "FEDFTG", "generator")):',
                    'with seeded(derive_seed(context.seed, "fedftg", "XXgeneratorXX")):',
                    'with seeded(derive_seed(context.seed, "fedftg", "GENERATOR")):')},
    "fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁattach: architecture = context.architectures[1]":
        "the architectures were checked to be one just above: every entry is the first",
    **{f"fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁbegin_round: {line}": "zip's strict defaults to False"
       for line in ("for teacher, upload in zip(self.teachers, uploads, strict=None):",
                    "for teacher, upload in zip(self.teachers, uploads, ):")},
    "fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁbegin_round: counts = label_counts[[u.client_id for u in "
    "uploads]].to(None)": "class_ensemble_weights and label_sampling_distribution take the counts in float64 "
    "themselves",
    "fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁbegin_round: assert isinstance(self.base, FedAvgServer) or "
    "self.context.model_factory is not None": "an assertion of what attach checked: no computation depends on it",
    "fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁsetup_uploads: return [LabelCountsPayload(counts=row.to(None)) "
    "for row in counts]": "the context's label counts are int64 already (ServerContext keeps them so)",
    "fedhet.algorithms.fedftg.xǁDataFreeFineTuningǁtraining_step: loss = None": "student_steps is a PositiveInt: "
    "the loop always reassigns it",
    "fedhet.algorithms.fedftg.xǁConditionalImageGeneratorǁ__init__: nn.BatchNorm2d(channels, affine=None),":
        "BatchNorm reads affine as a truth value: None, like False, creates no affine parameters",
    "fedhet.functional.image_statistics.x_mean_rms_change: return (after.double() - before.double()).flatten(1)"
    ".pow(2).mean(+1).sqrt().mean()": "after flatten(1) the tensor is 2-D: dim 1 is dim -1",
    **{f"fedhet.algorithms.fedktl.xǁFedKTLǁetf: seed = derive_seed(self.hp.shared_seed, {args})": "the ETF's seed "
       "stream only needs to be fixed and the same on every party (the paper names none): any fixed derivation from "
       "shared_seed gives an equally valid ETF (shared_seed's part is tested)"
       for args in ('"fedktl-etf", None, dim', '"fedktl-etf", num_classes, None', "num_classes, dim",
                    '"fedktl-etf", dim', '"fedktl-etf", num_classes, ', '"fedktl-etf", num_classes',
                    '"XXfedktl-etfXX", num_classes, dim', '"FEDKTL-ETF", num_classes, dim')},
    **{f"fedhet.algorithms.fedktl.xǁFedKTLClientǁ{where}: {line}": "the pair stream's cursor is set to 0 before "
       "its first use: next_pairs draws a new order whenever the order is None, which it is here"
       for where, line in (("__init__", "self._pair_cursor = None"), ("__init__", "self._pair_cursor = 1"),
                           ("on_train_start", "self._pair_order, self._pair_cursor = None, 1"))},
    "fedhet.algorithms.fedktl.xǁFedKTLClientǁ__init__: self.pair_images: Tensor | None = \"\"": "nothing reads "
    "pair_images before on_receive sets it with the latents (every use is guarded by pair_latents)",
    "fedhet.algorithms.fedktl.xǁFedKTLClientǁ__init__: self.register_buffer(\"etf\", etf.detach().clone().float(), "
    "persistent=None)": "register_buffer reads persistent as a truth value: None, like False, keeps it out of "
    "the state dict",
    **{f"fedhet.algorithms.fedktl.xǁFedKTLClientǁon_train_start: {line}": "on_receive sets the images and "
       "latents together, so the moved branch runs exactly when both are set; moving to the device is a no-op on "
       "a CPU-only machine (benchmarks/gpu_check.py runs FedKTL on cuda)"
       for line in ("if self.pair_images is not None or self.pair_latents is not None:",
                    "if self.pair_images is None and self.pair_latents is not None:",
                    "if self.pair_images is not None and self.pair_latents is None:",
                    "self.pair_images = self.pair_images.to(None)", "self.pair_latents = self.pair_latents.to(None)")},
    "fedhet.algorithms.fedktl.xǁFedKTLClientǁnext_pairs: index = torch.cat(picked).to(None)": "an index "
    "built on the CPU is already on the pairs' device on a CPU-only machine (benchmarks/gpu_check.py runs cuda)",
    **{f"fedhet.algorithms.fedktl.xǁFedKTLServerǁconfigure_optimizers: {line}": "Adam's defaults are "
       "betas (0.9, 0.999), eps 1e-8 and weight decay 0: the arguments restate them (as the authors' code does)"
       for line in ("return torch.optim.Adam(params, lr=self.hp.server_lr, eps=1e-8, weight_decay=0.0)",
                    "return torch.optim.Adam(params, lr=self.hp.server_lr, betas=(0.9, 0.999), weight_decay=0.0)",
                    "return torch.optim.Adam(params, lr=self.hp.server_lr, betas=(0.9, 0.999), eps=1e-8, )")},
    "fedhet.algorithms.fedktl.xǁFedKTLServerǁconfigure_optimizers: assert self.transformer is not None or "
    "self.centroids is not None": "an assertion: setup_server builds the transformer and the centroids together",
    "fedhet.algorithms.fedktl.xǁFedKTLServerǁdownload_for: if self.pair_images is None and self.pair_latents "
    "is None:": "finish_round and load_server_state set the images and latents together",
    "fedhet.algorithms.fedktl.xǁFedKTLClientǁnext_pairs: assert self.pair_images is not None or "
    "self.pair_latents is not None": "an assertion: on_receive sets the images and latents together",
    "fedhet.algorithms.fedktl.xǁFedKTLServerǁserver_state: if self.pair_images is not None or "
    "self.pair_latents is not None:": "finish_round and load_server_state set the images and latents together",
    # fedktl.py's survivors read on 2026-11-28 (14 others were gaps, killed by tests of test_fedktl.py)
    **{f"fedhet.algorithms.fedktl.xǁFedKTLServerǁ__init__: {line}": "a placeholder that setup_server() replaces "
       "(the loop sets a server up before anything else), or one aggregate() resets before the first fit and that "
       "nothing reads earlier (metrics() before any round reads _sums only when _steps is truthy, and _sums is "
       "empty); prototype_dim under use_etf=False is replaced by the head's input size"
       for line in (
           "self.prototype_dim: int | None = self.hp.etf_dim if (self.hp.use_etf) or True else None",
           "self.num_classes = None", "self.num_classes = 1",
           'self.held: Tensor | None = ""  # [clients, classes] examples each client holds, when the context knows',
           'self.transformer: nn.Sequential | None = ""', 'self.centroids: nn.Embedding | None = ""',
           "self.prototypes = None", "self.prototypes = torch.zeros(0)", "self.prototypes = torch.zeros(0, )",
           "self.prototypes = torch.zeros(1, 0)", "self.prototypes = torch.zeros(0, 1)",
           "self.prototype_labels = None", "self.prototype_labels = torch.zeros(0, dtype=None)",
           "self.prototype_labels = torch.zeros(0, )", "self.prototype_labels = torch.zeros(1, dtype=torch.long)",
           "self._finished = None", "self._finished = False",
           "self._sums: dict[str, float] = None", "self._steps = None", "self._steps = 1")},
    "fedhet.algorithms.fedktl.xǁFedKTLServerǁ__init__: self.pair_latents: Tensor | None = \"\"": "every read of "
    "pair_latents checks pair_images (None until finish_round sets both) or its length (0 for \"\")",
    "fedhet.algorithms.fedktl.xǁFedKTLServerǁ__init__: self.image_spec: tuple[int, int, tuple[float, ...], "
    "tuple[float, ...]] | None = \"\"": "server_dataloader() sets the image format before the fit that makes "
    "the first images; metrics() reads it only once images exist",
    **{f"fedhet.algorithms.fedktl.xǁFedKTLServerǁ{where}: {line}": "an assertion that guards against a server "
       "used before setup_server(), which builds the transformer and the centroids together; its message is "
       "for a programming error"
       for where, line in (
           ("aggregate", 'assert self.transformer is not None or self.centroids is not None, "setup_server() was '
            'not called"'),
           ("aggregate", 'assert self.transformer is not None and self.centroids is not None, "XXsetup_server() '
            'was not calledXX"'),
           ("aggregate", 'assert self.transformer is not None and self.centroids is not None, "SETUP_SERVER() WAS '
            'NOT CALLED"'),
           ("on_before_optimizer_step", "assert self.transformer is not None or self.centroids is not None"),
           ("server_losses", "assert self.transformer is not None or self.centroids is not None"))},
    **{f"fedhet.algorithms.fedktl.xǁFedKTLServerǁ{where}: {line}": "an empty start of the concatenation: "
       "torch.cat skips 1-D empty tensors beside [n, K] ones, and with no prototypes at all nothing reads their "
       "width (no centroid update, no batches, a count of 0)"
       for where, line in (
           ("aggregate", "prototypes, labels = [torch.zeros(0, )], [torch.zeros(0, dtype=torch.long)]"),
           ("aggregate", "prototypes, labels = [torch.zeros(0, self.prototype_dim or 1)], "
            "[torch.zeros(0, dtype=torch.long)]"),
           ("setup_server", "self.prototypes = torch.zeros(0, )"))},
    "fedhet.algorithms.fedktl.xǁFedKTLServerǁaggregate: self._finished = None": "finish_round tests _finished "
    "for truth: None is False",
    "fedhet.algorithms.fedktl.xǁFedKTLServerǁmetrics: out = {k: v / self._steps for k, v in self._sums.items()} "
    "if (self._steps) or True else {}": "_sums and _steps are reset together and _sums is empty while _steps is 0",
    **{f"fedhet.algorithms.fedktl.xǁFedKTLServerǁserver_losses: {line}": "the generator's latents are float32 on "
       "the CPU like F's outputs on a CPU-only machine (benchmarks/gpu_check.py runs FedKTL on cuda)"
       for line in ("latents = self.generator.sample_w(len(index)).to(None, mapped.dtype)",
                    "latents = self.generator.sample_w(len(index)).to(mapped.device, None)",
                    "latents = self.generator.sample_w(len(index)).to(mapped.dtype)",
                    "latents = self.generator.sample_w(len(index)).to(mapped.device, )")},
    **{f"fedhet.algorithms.fedktl.xǁ{where}: {line}": "a seed salt: any fixed label derives an equally valid "
       "stream (that the run seed and shared_seed reach it is tested)"
       for where, line in (
           ("FedKTLServerǁsetup_server", 'with seeded(derive_seed(context.seed, None)):'),
           ("FedKTLServerǁsetup_server", 'with seeded(derive_seed(context.seed, )):'),
           ("FedKTLServerǁsetup_server", 'with seeded(derive_seed(context.seed, "XXfedktl-server-initXX")):'),
           ("FedKTLServerǁsetup_server", 'with seeded(derive_seed(context.seed, "FEDKTL-SERVER-INIT")):'),
           ("FedKTLǁbuild_client", "latent_head_seed=derive_seed(self.hp.shared_seed, None),"),
           ("FedKTLǁbuild_client", "latent_head_seed=derive_seed(self.hp.shared_seed, ),"),
           ("FedKTLǁbuild_client", 'latent_head_seed=derive_seed(self.hp.shared_seed, "XXfedktl-latent-headXX"),'),
           ("FedKTLǁbuild_client", 'latent_head_seed=derive_seed(self.hp.shared_seed, "FEDKTL-LATENT-HEAD"),'),
           ("FedKTLǁetf", "seed = derive_seed(self.hp.shared_seed, None, num_classes, dim)"))},
    "fedhet.algorithms.fedktl.xǁFedKTLServerǁsetup_server: head = context.initial_client_state(1)"
    "[\"model.head.weight\"]": "in the -ETF ablation every client's head takes the scenario's one feature size "
    "(prototypes of other sizes are refused), so any client's head gives it",
    **{f"fedhet.algorithms.fedktl.x_to_client_images: {line}": "the generator's images are [B, C, H, W] with "
       "C (1 or 3) never the image size, so the test either resizes exactly as before or resizes to the same "
       "size, which antialiased bilinear interpolation leaves unchanged; for 4-D input shape[2] is shape[-2]"
       for line in ("if images.shape[+1] != image_size or images.shape[-2] != image_size:",
                    "if images.shape[-1] != image_size or images.shape[+2] != image_size:",
                    "if images.shape[-1] != image_size or images.shape[-3] != image_size:")},
    **{f"fedhet.algorithms.fedktl.x_to_client_images: {line}": "align_corners defaults to False for bilinear"
       for line in ('images = F.interpolate(images, size=size, mode="bilinear", align_corners=None, antialias=True)',
                    'images = F.interpolate(images, size=size, mode="bilinear", antialias=True)')},
    **{f"fedhet.algorithms.fedktl.x_to_client_images: {line}": "a [C, 1, 1] tensor broadcasts over [B, C, H, W] "
       "exactly as [1, C, 1, 1]; the generator's images are float32, torch.tensor's default"
       for line in ("mean_t = torch.tensor(mean, dtype=images.dtype, device=images.device).view(-1, 1, 1)",
                    "mean_t = torch.tensor(mean, dtype=None, device=images.device).view(1, -1, 1, 1)",
                    "mean_t = torch.tensor(mean, device=images.device).view(1, -1, 1, 1)",
                    "std_t = torch.tensor(std, dtype=images.dtype, device=images.device).view(-1, 1, 1)",
                    "std_t = torch.tensor(std, dtype=None, device=images.device).view(1, -1, 1, 1)",
                    "std_t = torch.tensor(std, device=images.device).view(1, -1, 1, 1)")},
    "fedhet.algorithms.fedmdcg.xǁFedMDCGClientǁramp: return ramp_weight(self.round_idx, max(self.total_rounds, 2), "
    "self.hp.ramp, self.hp.ramp_power)": "the guard differs only for total_rounds 1 with round_idx >= 1, which no run "
    "reaches (round_idx < total_rounds; a client alone has 1 and 0): ramp 0 either way",
    "fedhet.algorithms.base.xǁClientModuleǁ__init_subclass__: if upload is not None and not getattr(upload, "
    "\"__fedhet_guarded__\", None):": "an unguarded make_upload has no such attribute: the default None is as falsy "
    "as False",
    "fedhet.algorithms.base.x__first_line: for line in (function.__doc__ or \"XXXX\").splitlines():": "a constructor "
    "without a docstring has no line to match either way: the placeholder never starts with '<parameter>:'",
    "fedhet.algorithms.base.x__first_line: return line.split(None, 1)[1].strip()": "the matched line starts with "
    "'<parameter>:' and Google-style docstrings put a space after that colon: splitting at the first blank or at the "
    "first colon leaves the same description once stripped",
    **{f"fedhet.algorithms.base.xǁClientModuleǁlog_train_loss: self.log(\"train/loss\", loss, {arguments})": "called "
       "from training_step, Lightning's self.log takes on_step=None (or no on_step) as True, that hook's default"
       for arguments in ("on_step=None, on_epoch=True, prog_bar=True", "on_epoch=True, prog_bar=True")},
    "fedhet.algorithms.base.x__hparams_init: if \"__init__\" in base.__dict__ and getattr(base.__dict__[\"__init__\"], "
    "\"__fedhet_extra_parameters__\", None)": "an unflagged constructor has no such attribute: the default None is as "
    "falsy as False",
    **{f"fedhet.algorithms.base.x__hparams_init: hints = typing.get_type_hints(parent_init, {arguments})": "without "
       "globalns, get_type_hints reads a function's own __globals__, which for a constructor written in a module is "
       "that module's namespace: the same names resolve" for arguments in ("globalns=None", "")},
    **{f"fedhet.algorithms.shared.common.xǁParameterBuffersǁ__init__: owner.register_buffer(leaf, "
       f"torch.zeros_like(parameter, {arguments}))": "zeros_like's requires_grad defaults to False (None is taken "
       "as False): the same buffer" for arguments in ("requires_grad=None", "")},
    **{f"fedhet.algorithms.shared.common.xǁParameterBuffersǁas_dict: return dict(zip(self.names, self.tensors(), "
       f"{arguments}))": "names and tensors come from the same named_parameters() list: always the same length"
       for arguments in ("strict=None", "", "strict=False")},
    **{f"fedhet.algorithms.shared.common.xǁSeparatelyClippedClientǁconfigure_gradient_clipping: "
       f"self.clip_gradients({arguments})": "Lightning calls this hook with the trainer's gradient_clip_val and "
       "gradient_clip_algorithm, and clip_gradients takes the trainer's value for a None: the same clip"
       for arguments in ("optimizer, None, gradient_clip_algorithm", "optimizer, gradient_clip_val, None",
                         "optimizer, gradient_clip_val, ")},
    **{f"fedhet.algorithms.shared.common.xǁPublicDistillationPhaseǁtraining_step: {line}": "Lightning's optimizer "
       "wrapper forwards .state to the optimizer it wraps (LightningOptimizer.__getattr__): the same dict is cleared"
       for line in ("getattr(None, \"optimizer\", optimizer).state.clear()",
                    "getattr(optimizer, \"optimizer\", None).state.clear()",
                    "getattr(optimizer, \"optimizer\", ).state.clear()",
                    "getattr(optimizer, \"XXoptimizerXX\", optimizer).state.clear()",
                    "getattr(optimizer, \"OPTIMIZER\", optimizer).state.clear()")},
    "fedhet.algorithms.fedvtc.xǁFedVTCClientǁon_receive: None":  # the mutant is download.prototypes.to(None)
    "an index assignment casts its source to the buffer's dtype; the device is the buffer's on a CPU-only "
    "machine (benchmarks/gpu_check.py runs FedVTC on cuda)",
    **{f"fedhet.algorithms.fedvtc.xǁFedVTCServerǁ__init__: {line}": "a placeholder that setup_server() replaces "
       "(the loop sets a server up before anything else, also on resume); vtc_averaged and broadcast_all are read "
       "only as truth values, where None is False (and load_server_state reads them through bool()); "
       "finetune_done is set by the first fine-tuning aggregate before any fine-tuning download reads it; "
       "rounds_done is compared with a positive round count, which equals neither 0 nor None"
       for line in (
           "self.anchor_norm = None", "self.anchor_norm = 1.0", "self.num_classes = None", "self.num_classes = 1",
           "self.owned = None", "self.owned = torch.zeros(0, 0, dtype=None)", "self.owned = torch.zeros(0, 0, )",
           "self.owned = torch.zeros(0, dtype=torch.bool)", "self.owned = torch.zeros(1, 0, dtype=torch.bool)",
           "self.owned = torch.zeros(0, 1, dtype=torch.bool)", "self.prototypes = None",
           "self.prototypes = torch.zeros(0)", "self.prototypes = torch.zeros(0, )",
           "self.prototypes = torch.zeros(1, 0)", "self.prototypes = torch.zeros(0, 1)", "self.sigma = None",
           "self.sigma = torch.zeros(1)", "self.vtc: dict[str, Tensor] = None", "self.vtc_averaged = None",
           "self.broadcast_all = None", "self.finetune_done = 1", "self.rounds_done = None",
       )},
    **{f"fedhet.algorithms.fedvtc.x_initial_prototypes: generator = torch.Generator().manual_seed({call})":
       "a seed salt: any fixed label derives an equally valid stream (that the seed reaches it is tested)"
       for call in ('derive_seed(seed, None)', 'derive_seed(seed, )', 'derive_seed(seed, "XXfedvtc-prototypesXX")',
                    'derive_seed(seed, "FEDVTC-PROTOTYPES")')},
    **{f"fedhet.algorithms.fedvtc.xǁLatentPriorǁ__init__: {line}": "torch.tensor of a Python int is int64 already"
       for line in ('self.register_buffer("synthetic_seed", torch.tensor(-1, dtype=None))',
                    'self.register_buffer("synthetic_seed", torch.tensor(-1, ))')},
    "fedhet.algorithms.fedvtc.xǁFedVTCClientǁvtc_target: return pixels.mean(1, keepdim=True) if "
    "self.vtc.out_channels == 1 and pixels.shape[1] != 2 else pixels": "the mean over a single channel is that "
    "channel: one-channel pixels give the same target either way",
    "fedhet.algorithms.fedvtc.xǁFedVTCClientǁ__init__: self.automatic_optimization = None": "Lightning reads "
    "automatic_optimization for truth: None is manual optimisation, as False",
    "fedhet.algorithms.fedvtc.xǁFedVTCClientǁ__init__: self.latent = LatentPrior(None, latent_dim, "
    "self.hp.prior_sd, anchors)": "LatentPrior reads num_classes only without initial prototypes, and the client "
    "always passes its anchors (zeros by default)",
    **{f"fedhet.algorithms.fedvtc.xǁFedVTCClientǁ__init__: {line}": reason for line, reason in (
        *((f'self.register_buffer("{name}", torch.tensor(list({name})).view(1, -1, 1, 1), persistent=None)',
           "register_buffer tests persistent for truth: None is False") for name in ("pixel_mean", "pixel_std")),
        *((f'self.register_buffer("{name}", torch.tensor(list({name})).view(-1, 1, 1), persistent=False)',
           "a [C, 1, 1] tensor broadcasts over [B, C, H, W] exactly as [1, C, 1, 1]")
          for name in ("pixel_mean", "pixel_std")),
        ("self.last_terms: dict[str, float] = None", "read only after vtc_loss sets it (diagnostics and tests)"))},
    **{f"fedhet.algorithms.fedbn.xǁFedBNServerǁsetup_server: assert context.model_factory is not None, {text}":
       "an assertion of the loop's contract (every ServerContext the loop builds has a model factory); its "
       "message is for a programming error"
       for text in ('"XXFedBN\'s server needs the model factory to find BatchNorm layersXX"',
                    '"fedbn\'s server needs the model factory to find batchnorm layers"',
                    '"FEDBN\'S SERVER NEEDS THE MODEL FACTORY TO FIND BATCHNORM LAYERS"')},
    **{f"fedhet.algorithms.lg_fedavg.xǁLGFedAvgServerǁ__init__: super().__init__(\"model.\" + HEAD_PREFIX, {args})":
       "SubmoduleAveragingServer reads per_architecture and send_initial for truth: None is False"
       for args in ("per_architecture=None, send_initial=False", "per_architecture=False, send_initial=None")},
    "fedhet.algorithms.fedper.xǁFedPerClientǁon_receive: self.model.load_state_dict(download.weights, "
    "strict=None)": "load_state_dict reads strict for truth: None is False",
    "fedhet.algorithms.fedvtc.xǁFedVTCǁbuild_vtc: with torch.random.fork_rng(devices=None):": "the VTC is drawn "
    "from the CPU generator; forking the CUDA generators as well (devices=None) restores them unchanged",
    **{f"fedhet.algorithms.fedvtc.xǁFedVTCǁbuild_vtc: {line}": "a seed salt: any fixed label derives an equally "
       "valid stream (that vtc_init_seed reaches it is tested)"
       for line in ('torch.manual_seed(derive_seed("fedvtc-vtc"))',
                    *(f"torch.manual_seed(derive_seed(self.hp.vtc_init_seed, {salt}))"
                      for salt in ('"FEDVTC-VTC"', '"XXfedvtc-vtcXX"', "", "None")))},
    "fedhet.algorithms.fedvtc.xǁFedVTCǁbuild_client: model = linear_feature_projection(model, shape[0] * shape[2] "
    "* shape[2])": "the latent is square (image_size // 4 by image_size // 4): shape[1] == shape[2]",
    "fedhet.algorithms.fedvtc.xǁFedVTCClientǁtraining_step: return super().training_step(batch, None)":
    "ClientModule.training_step does not read batch_idx",
    **{f"fedhet.algorithms.fedvtc.xǁFedVTCServerǁsetup_server: {line}": "without label counts every client owns "
       "every class: a mask of float ones is read only by .all() and nonzero(), where 1.0 is True"
       for line in ("else torch.ones(context.num_clients, self.num_classes, dtype=None)",
                    "else torch.ones(context.num_clients, self.num_classes, )")},
    **{f"fedhet.algorithms.fedvtc.xǁFedVTCClientǁmake_upload: {line}": "a client's per-class example counts are "
       "integers far below 2**24, exact in float32; the division by them promotes to the sums' float64 either way"
       for line in ("counts = torch.zeros(self.num_classes, dtype=None)", "counts = torch.zeros(self.num_classes, )")},
    "fedhet.algorithms.shared.common.xǁPublicDistillationPhaseǁtraining_step: super().training_step(batch, None)":
    "CollaborativePhase.training_step does not read batch_idx",
    "fedhet.algorithms.shared.common.xǁClassMeanServerǁdownload_for: if self.global_means is None and self.present "
    "is None:": "global_means and present are set together (aggregate, load_server_state): both None or neither",
    "fedhet.algorithms.shared.common.xǁClassMeanServerǁaggregate: if self.dim is None or self.global_means is None:":
    "every upload passed check_upload against the declared width (or the last means' width) before aggregate, so "
    "the extra agreement check finds every upload of one width and passes",
    # survivors of ccvr.py, fedproc.py, fedmrl.py and fedmatch.py read on 2026-11-29 (the rest were gaps, now tested)
    **{f"fedhet.algorithms.{where}ǁ__init__: {line}": "a placeholder that setup_server() replaces (the loop sets a "
       "server up before anything else)"
       for where, line in (
           ("ccvr.xǁCCVRServer", "self.num_classes = None"), ("ccvr.xǁCCVRServer", "self.num_classes = 1"),
           ("ccvr.xǁCCVRServer", "self.dim = None  # the feature width p: every head's input width (CCVR needs one "
            "feature dimension)"),
           ("ccvr.xǁCCVRServer", "self.dim = 1  # the feature width p: every head's input width (CCVR needs one "
            "feature dimension)"),
           ("ccvr.xǁCCVRServer", 'self.held: Tensor | None = ""  # [clients, classes] examples each client holds, '
            "when the context knows"),
           ("fedproc.xǁFedProcServer", "self.num_classes = None"), ("fedproc.xǁFedProcServer", "self.num_classes = 1"),
           ("fedproc.xǁFedProcServer", 'self.held: Tensor | None = ""  # [clients, classes] examples each client '
            "holds, when the context knows"),
       )},
    "fedhet.algorithms.fedproc.xǁFedProcServerǁ__init__: self.present: Tensor | None = \"\"": "read only after "
    "global_prototypes, which aggregate and load_server_state set together with it (download_for tests "
    "global_prototypes first)",
    "fedhet.algorithms.fedproc.xǁFedProcServerǁdownload_for: if self.global_prototypes is None and self.present is "
    "None:": "global_prototypes and present are set together (aggregate, load_server_state): both None or neither",
    "fedhet.algorithms.fedproc.xǁFedProcServerǁaggregate: super().aggregate(None, uploads)  # averages the weights":
    "SubmoduleAveragingServer.aggregate does not read round_idx",
    **{f"fedhet.algorithms.shared.common.xǁSharedSubmoduleServerǁ__init__: super().__init__(self.shared_module + "
       f"\".\", weighting, {args})": "SubmoduleAveragingServer reads per_architecture and send_initial for truth (None "
       "is False) and declares send_initial=True"
       for args in ("per_architecture=None, send_initial=True", "per_architecture=False, ")},
    **{f"fedhet.algorithms.fedmrl.xǁFedMRLǁbuild_client: self.hp.small_model, num_classes, self.image_channels(), "
       f"self.hp.shared_init_seed, {salt}": "a seed salt: any fixed label derives an equally valid stream (that "
       "shared_init_seed reaches it is tested)"
       for salt in ('"XXfedmrl-smallXX",', '"FEDMRL-SMALL",', "None,", "")},
    **{f"fedhet.algorithms.fedmatch.xǁCutoutǁ__call__: {line}": "torch.randint(high, size) draws from [0, high) "
       "like randint(0, high, size), from the same generator"
       for line in ("centre_y = torch.randint(height, (batch,), generator=generator).to(images.device)",
                    "centre_x = torch.randint(width, (batch,), generator=generator).to(images.device)")},
    **{f"fedhet.algorithms.fedmatch.xǁCutoutǁ__call__: {line}": "the offsets are integers: |d| <= s // 2 holds "
       "exactly when |d| <= s / 2"
       for line in ("inside_y = (rows - centre_y[:, None]).abs() <= self.size / 2  # [B, H]",
                    "inside_x = (cols - centre_x[:, None]).abs() <= self.size / 2  # [B, W]")},
    "fedhet.algorithms.fedmatch.xǁFedMatchPhaseǁstrong_view: generator = torch.Generator().manual_seed(int("
    "torch.randint(2**62, (1,)).item()))": "torch.randint(high, size) draws from [0, high) like randint(0, high, "
    "size), from the same (global) generator",
    "fedhet.algorithms.fedkd.xǁFedKDClientǁ__init__: self.hidden_map = nn.Linear(int(student.num_features), "
    "int(model.num_features), bias=None)  # type: ignore[arg-type]": "nn.Linear reads bias for truth: None is False",
    "fedhet.algorithms.fedkd.xǁFedKDClientǁ__init__: self.student_at_start: dict[str, Tensor] = None": "read only "
    "through make_upload's `or`, where None and {} are both false (on_receive sets it before any training)",
    "fedhet.algorithms.fedkd.xǁFedKDServerǁ__init__: self.global_student: dict[str, Tensor] = None": "a placeholder "
    "that setup_server() replaces (the loop sets a server up before anything else)",
    "fedhet.algorithms.fedkd.xǁFedKDServerǁaggregate: weights = [u.payload.num_examples if "
    "self.hp.student_weighting == \"samples\" else 2 for u in uploads]": "weighted_average normalises the weights: "
    "equal weights of 2 are equal weights of 1",
    "fedhet.algorithms.fedkd.xǁFedKDServerǁaggregate: k: (v + mean[k].to(None)) if v.is_floating_point() else "
    "mean[k]": "weighted_average returns each entry in the first upload's dtype, which check_upload pinned to the "
    "global student's: the cast is idle",
    "fedhet.algorithms.fedkd.xǁSVDStatePayloadǁvalidate_against: rank = factors[\"s\"].shape[0] if "
    "isinstance(factors[\"s\"], Tensor) and factors[\"s\"].dim() == 1 else -2": "any rank below 1 fails the next "
    "line's check, with the same message",
    **{f"fedhet.algorithms.fedkd.xǁFedKDǁbuild_client: self.hp.student_model, num_classes, self.image_channels(), "
       f"self.hp.shared_init_seed, {salt}": "a seed salt: any fixed label derives an equally valid stream (that "
       "shared_init_seed reaches it is tested)"
       for salt in ('"XXfedkd-studentXX"', '"FEDKD-STUDENT"', "None")},
    "fedhet.algorithms.fedcg.xǁFedCGClientǁtraining_step: return super().training_step(batch, None)":
    "GeneratorClassifierClient.training_step does not read batch_idx",
    "fedhet.algorithms.fedcg.xǁLatentDiscriminatorǁforward: features = torch.cat([features, F.one_hot(labels, "
    "self.num_classes).to(None)], dim=1)": "torch.cat promotes the one-hot's int64 to the features' floating dtype: "
    "the same values",
    **{f"fedhet.algorithms.fedl2g.xǁFedL2GClientǁ__init__: {line}": "on_train_start resets it at the start of "
       "every meta stage, the only stage that reads it" for line in ("self._study: list[Batch] = None",
                                                                      "self._quiz: list[Batch] = None")},
    **{f"fedhet.algorithms.fedl2g.xǁFedL2GClientǁlearn_to_guide: {line}": CPU_ONLY
       for line in ("device = None", "device = study[0][1].device",
                    "guide = self.guide.to(None).detach().clone().requires_grad_(True)",
                    "values = (guide_grad.detach() * rows.to(None).unsqueeze(1)).float().cpu()")},
    **{f"fedhet.algorithms.fedl2g.xǁFedL2GClientǁlearn_to_guide: for n, g in zip(names, grads{tail}": "grads "
       "has one entry per name (torch.autograd.grad over [params[n] for n in names]): zip's strict is idle"
       for tail in (", strict=None)", ", )", ", strict=False)")},
    "fedhet.algorithms.fedl2g.xǁFedL2GClientǁtraining_step: return super().training_step(batch, None)":
    "ClientModule.training_step does not read batch_idx",
    **{f"fedhet.algorithms.fedl2g.xǁFedL2GServerǁ__init__: {line}": "a placeholder that setup_server() replaces "
       "(the loop sets a server up before anything else)"
       for line in ("self.num_classes = None", "self.num_classes = 1", "self.dim = None", "self.dim = 1",
                    'self.label_counts: Tensor | None = ""', "self.guide = None", "self.guide = torch.zeros(0)",
                    "self.guide = torch.zeros(0, )", "self.guide = torch.zeros(1, 0)", "self.guide = torch.zeros(0, 1)",
                    "self.present = None", "self.present = torch.zeros(0, dtype=None)",
                    "self.present = torch.zeros(0, )", "self.present = torch.zeros(1, dtype=torch.bool)")},
    "fedhet.algorithms.fedl2g.xǁFedL2GServerǁsetup_server: super().setup_server(None)": "ServerPhase.setup_server "
    "only keeps the context, which this server never reads",
    **{f"fedhet.algorithms.fedl2g.xǁFedL2GServerǁsetup_server: with seeded(derive_seed({args})):": "a seed salt: "
       "any fixed label derives an equally valid stream (that the run seed reaches it is tested)"
       for args in ('context.seed, None, self.level', "context.seed, self.level", 'context.seed, "fedl2g-guide", None',
                    'context.seed, "fedl2g-guide", ', 'context.seed, "XXfedl2g-guideXX", self.level',
                    'context.seed, "FEDL2G-GUIDE", self.level')},
    **{f"fedhet.algorithms.fedl2g.xǁFedL2GServerǁsetup_server: {line}": "no class guided yet: float zeros sum to "
       "the same 0 as boolean ones, and the first aggregate replaces them with guidance_update's mask"
       for line in ("self.present = torch.zeros(self.num_classes, dtype=None)",
                    "self.present = torch.zeros(self.num_classes, )")},
    "fedhet.algorithms.fedgen.xǁFeatureGeneratorǁforward: inputs = torch.cat([noise, F.one_hot(labels, "
    "self.num_classes).to(None)], dim=1)": "torch.cat promotes the one-hot's int64 to the noise's floating dtype: "
    "the same values",
    **{f"fedhet.algorithms.fedgen.xǁFedGenServerǁ__init__: {line}": "a placeholder that setup_server() or the "
       "round's aggregate() replaces before anything reads it (the loop sets a server up first; a fit follows an "
       "aggregate); float('NAN') is the same NaN"
       for line in ("self.num_classes = None", "self.num_classes = 1",
                    'self.held: Tensor | None = ""  # [clients, classes] examples each client holds, when the context '
                    "knows", "self.round_heads: list[dict[str, Tensor]] = None",
                    'self.round_ensemble_weights: Tensor | None = ""  # [K, C]', "self.steps_done = None",
                    "self.steps_done = 1", 'self.first_loss = float("NAN")', 'self.last_loss = float("NAN")')},
    **{f"fedhet.algorithms.fedgen.xǁFedGenServerǁaggregate: {line}": "example counts are integers below 2**24: "
       "they sum exactly in float32, and a float64 quotient rounded to float32 equals the float32 quotient (53 >= "
       "2 x 24 + 2 bits: double rounding is innocuous for division); weighted_average reads the same integers"
       for line in ("examples = torch.tensor([float(u.payload.num_examples) for u in uploads], dtype=None)",
                    "examples = torch.tensor([float(u.payload.num_examples) for u in uploads], )")},
    **{f"fedhet.algorithms.fedgen.xǁFedGenServerǁaggregate: {line}": "[C] broadcasts over [K, C] as [1, C] does"
       for line in ("weights = counts / counts.sum(0, ).clamp_min(1.0)",
                    "weights = counts / counts.sum(0, keepdim=False).clamp_min(1.0)")},
    "fedhet.algorithms.fedgen.xǁFedGenServerǁensemble_logits: logits = torch.zeros(self.num_classes, "
    "device=features.device)": "a [C] start broadcasts against the first head's [B, C] logits to the same [B, C] "
    "sum (a round has at least one upload)",
    **{f"fedhet.algorithms.fedgen.xǁFedGenServerǁsetup_server: with seeded(derive_seed({args})):": "a seed salt: "
       "any fixed label derives an equally valid stream (that the run seed reaches it is tested)"
       for args in ('context.seed, None, "generator"', 'context.seed, "generator"', 'context.seed, "fedgen", None',
                    'context.seed, "fedgen", ', 'context.seed, "XXfedgenXX", "generator"',
                    'context.seed, "FEDGEN", "generator"', 'context.seed, "fedgen", "GENERATOR"',
                    'context.seed, "fedgen", "XXgeneratorXX"')},
    **{f"fedhet.algorithms.fedgen.xǁFedGenServerǁsetup_server: {line}": "a round counter read only through int() "
       "and incremented by 1: float zeros count the same"
       for line in ('self.register_buffer("rounds_trained", torch.zeros((), dtype=None))',
                    'self.register_buffer("rounds_trained", torch.zeros((), ))')},
    **{f"fedhet.algorithms.rhfl.xǁClientConfidenceServerǁ__init__: {line}": "a placeholder that setup_server() or "
       "load_server_state() replaces before anything reads it"
       for line in ("self.previous_loss = torch.zeros(1)", "self.previous_loss = None",
                    "self.confidence = torch.zeros(1)", "self.confidence = None")},
    "fedhet.algorithms.rhfl.xǁRHFLPhaseǁpeer_confidences: weights = [getattr(self.clients[index], \"confidence\", ) "
    "for index in self.exchanging]": "every participant of RHFL's phase is an RHFLClient, whose constructor sets "
    "confidence: the default is never used",
    # SCAFFOLD's and FedDyn's server (CorrectedAverageServer): a uniform average of the buffers plus one state per group
    **{f"fedhet.algorithms.shared.common.xǁCorrectedAverageServerǁ__init__: {line}": reason
       for line, reason in (
           *((f"self.weighting = {value}", "SubmoduleAveragingServer weighs by examples only for 'samples': any "
              "other value averages uniformly, as 'uniform' does") for value in ('"XXuniformXX"', '"UNIFORM"', "None")),
           *((line, "a placeholder that setup_server() replaces (it rebuilds an empty or missing state)")
             for line in ("self.state_by_architecture: dict[str, dict[str, Tensor]] = None",
                          "self.clients_by_architecture: dict[str, int] = None")))},
    "fedhet.algorithms.shared.common.xǁCorrectedAverageServerǁaggregate: super().aggregate(None, uploads)  "
    "# validates; global <- uniform mean of the uploads (buffers too)":
    "SubmoduleAveragingServer.aggregate does not read round_idx",
    "fedhet.algorithms.scaffold.xǁScaffoldClientǁ_reset_round: self.correction: list[Tensor] = None  # c - c_i, "
    "fixed during the local update": "read only for truth (on_before_optimizer_step) until on_fit_start sets it: "
    "None and [] are both false",
    **{f"fedhet.algorithms.scaffold.xǁScaffoldClientǁon_fit_start: c - c_i for c, c_i in zip(self.server_control, "
       f"self.control_variate.tensors(){tail}": "both lists hold one tensor per model parameter: zip's strict is idle"
       for tail in (", )", ", strict=False)", ", strict=None)")},
    **{f"fedhet.algorithms.feddf_server.xǁEnsembleDistillationǁ__init__: {line}": "begin_round() sets it before "
       "the round's refinement reads it; before any round should_refine() reads the teachers for truth (None is "
       "false) and metrics() reads the sum only when loss_steps is truthy"
       for line in ("self.teachers: list[tuple[str, dict[str, Tensor]]] = None",
                    "self.client_bn_stats: dict[str, list[dict[str, Tensor]]] = None", "self.loss_sum = None",
                    "self.loss_steps = None")},
    f"{GENERATORS}ConditionalFeatureGeneratorǁforward: inputs = torch.cat([noise, F.one_hot(labels, "
    "self.num_classes).to(None)], dim=1)": "torch.cat promotes the one-hot's int64 to the noise's floating dtype: "
    "the same values",
    **{f"{GENERATORS}{where}: {line}": CPU_ONLY for where, line in (
        ("ConditionalFeatureGeneratorǁforward", "noise = self.sample_noise(labels.shape[0], None)"),
        ("ConditionalFeatureGeneratorǁsample_noise", "return torch.randn(count, self.noise_dim, device=None)"),
        ("ConditionalFeatureGeneratorǁsample_noise", "return torch.randn(count, self.noise_dim, )"),
        ("ConditionalFeatureGeneratorǁsample_noise", "return torch.rand(count, self.noise_dim, device=None)"),
        ("ConditionalFeatureGeneratorǁsample_noise", "return torch.rand(count, self.noise_dim, )"),
        ("GeneratorClassifierServerǁdistillation_loss", "noise = self.generator.sample_noise(labels.shape[0], None)"),
        ("GeneratorClassifierServerǁdistillation_loss",
         "noise if self.hp.share_server_noise else local_generator.sample_noise(labels.shape[0], None)"),
    )},
    **{f"{GENERATORS}{where}: self.has_global = None": "has_global is read only for truth: None is False"
       for where in ("GeneratorClassifierClientǁ__init__", "GeneratorClassifierClientǁon_receive")},
    **{f"{GENERATORS}{where}": "the label distribution is read only once has_global is true, which on_receive sets "
       "with it from a download" for where in (
           'GeneratorClassifierClientǁ__init__: self.label_distribution: Tensor | None = ""',
           'GeneratorClassifierClientǁon_receive: self.label_distribution = ""')},
    f"{GENERATORS}GeneratorClassifierMethodǁbuild_client: return self.client_type(model, num_classes, "
    "self.make_generator(None, num_classes), self.hp)  # type: ignore[call-arg]": "make_generator falls back to "
    "self.feature_dim, which build_client sets from the same model just before",
    **{f"{GENERATORS}GeneratorClassifierMethodǁmake_generator: with seeded(derive_seed({args})):": "one fixed seed for "
       "every party's G_i and the server's G (and the server loads client 0's generator over its own): any fixed "
       "derivation gives an equally valid common initialisation"
       for args in ('None, "fedmdcg", "generator"', '0, "fedmdcg", None', '"fedmdcg", "generator"', '0, "generator"',
                    '0, "fedmdcg", ', '1, "fedmdcg", "generator"', '0, "XXfedmdcgXX", "generator"',
                    '0, "FEDMDCG", "generator"', '0, "fedmdcg", "GENERATOR"', '0, "fedmdcg", "XXgeneratorXX"')},
    **{f"{GENERATORS}GeneratorClassifierServerǁ__init__: {line}": "a placeholder that setup_server() or the round's "
       "aggregate() replaces before anything reads it; should_refine() reads the teachers for truth and "
       "metrics() the losses only once a step ran (float('NAN') is the same NaN)"
       for line in ("self.num_classes = None", "self.num_classes = 1",
                    'self.held: Tensor | None = ""  # [clients, classes] examples each client holds, when the '
                    "context knows", "self.teachers: list[tuple[nn.Module, nn.Module]] = None",
                    'self.round_tau: Tensor | None = ""', 'self.round_sample_weights: Tensor | None = ""',
                    "self.first_loss = None", 'self.first_loss = float("NAN")', "self.last_loss = None",
                    'self.last_loss = float("NAN")', "self.steps_done = None")},
    **{f"{GENERATORS}GeneratorClassifierServerǁaggregate: {line}": "a list of Python floats becomes float32, torch's "
       "default dtype" for line in ("total = torch.tensor(examples, dtype=None)", "total = torch.tensor(examples, )")},
    **{f"{GENERATORS}GeneratorClassifierServerǁsetup_server: {line}": "a round counter read only through int() and "
       "incremented by 1: float zeros count the same"
       for line in ('self.register_buffer("rounds_aggregated", torch.zeros((), dtype=None))',
                    'self.register_buffer("rounds_aggregated", torch.zeros((), ))')},
    **{f"fedhet.algorithms.shared.cross_correlation.xǁCrossCorrelationCollaborationǁclient_optimizer: "
       f"return build_optimizer(client.model.parameters(), \"adam\", self.hp.public_lr, {momentum}, 0.0)":
       "build_optimizer's Adam takes no momentum argument" for momentum in ("1.0", "None")},
    **{f"fedhet.algorithms.fml.xǁFMLǁbuild_client: self.hp.meme_model, num_classes, self.image_channels(), "
       f"self.hp.shared_init_seed, {salt}": "a seed salt: any fixed label derives an equally valid stream (that "
       "shared_init_seed reaches it is tested)" for salt in ('"XXfml-memeXX"', '"FML-MEME"', "None")},
    **{f"fedhet.algorithms.fccl.xǁFCCLClientǁ__init__: {line}": "a flag read only through bool() and filled with "
       "True: float 0 and 1 read the same"
       for line in ('self.register_buffer("pretrained", torch.zeros((), dtype=None))',
                    'self.register_buffer("pretrained", torch.zeros((), ))')},
    "fedhet.algorithms.shared.cross_correlation.xǁCrossCorrelationCollaborationǁcollaborative_losses: "
    "upload.validate_shape(x.shape[0], classes, None, sender)  # shape, then finite values": "the phase computes "
    "the similarities itself from [B, p] features, always [B, B - 1]: the skipped check could not fail",
    **{f"fedhet.algorithms.moon.xǁMoonClientǁ__init__: {line}": "a flag read only through bool() and filled "
       "with True: float 0 and 1 read the same"
       for line in ('self.register_buffer("has_previous_model", torch.zeros((), dtype=None))',
                    'self.register_buffer("has_previous_model", torch.zeros((), ))')},
    **{f"fedhet.algorithms.moon.xǁMoonClientǁ{where}: self.has_global_model = None": "read only for truth: None "
       "is False" for where in ("__init__", "load_client_state")},
    **{f"fedhet.algorithms.moon.xǁProjectedClassifierǁ__init__: nn.ReLU(inplace={value}),": "the ReLU acts on "
       "the fresh output of the Linear before it, which nothing else reads: in place or not, the same values"
       for value in ("None", "False")},
    **{f"fedhet.algorithms.fedmatch.xǁFedMatchPhaseǁdistillation_losses: {line}": "one logit tensor per exchanging "
       "client (public_logits builds both lists from self.exchanging): zip's strict is idle"
       for line in ("for i, (client, z) in enumerate(zip(exchanging, logits, strict=None)):",
                    "for i, (client, z) in enumerate(zip(exchanging, logits, )):",
                    "for i, (client, z) in enumerate(zip(exchanging, logits, strict=False)):")},
}


def changed_lines(diff: str) -> tuple[list[str], list[str]]:
    """The removed and the added lines of a mutant's diff, stripped."""
    removed = [line[1:].strip() for line in diff.splitlines() if line.startswith("-")]
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+")]
    return removed, added


def equivalence_key(name: str, diff: str) -> str:
    """``<mutated function>: <mutated line>``, the key of :data:`EQUIVALENT`."""
    return f"{name.rsplit('__mutmut_', 1)[0]}: {' / '.join(changed_lines(diff)[1])}"


def equivalence_reason(name: str, diff: str) -> str | None:
    """Why the surviving mutant ``name`` is equivalent, or None when it is not judged so."""
    removed, added = changed_lines(diff)
    if len(removed) == len(added) == 1:
        for variants, reason in RULES:
            if added[0] in variants(removed[0]):
                return reason
    return EQUIVALENT.get(equivalence_key(name, diff))


def source_files() -> list[str]:
    """Every Python file of the mutated folders (``__init__`` files without code are skipped by mutmut)."""
    return sorted(str(path.relative_to(ROOT)) for folder in MUTATED for path in (ROOT / folder).rglob("*.py"))


def own_tests(source: str) -> list[str]:
    """The test files of ``source``: named after it, the extra ones above, and the functional doctests."""
    stem = Path(source).stem
    named = [f"tests/{folder}/{prefix}{stem}.py" for folder in ("algorithms", "functional")
             for prefix in ("test_", "test_oracle_")]  # fmt: skip
    tests = [t for t in named if (ROOT / t).exists()] + EXTRA_TESTS.get(source, [])
    if source.startswith("fedhet/functional/"):
        tests.append(DOCTESTS)
    missing = [t for t in tests if not (ROOT / t).exists()]
    if missing:
        raise SystemExit(f"error: {source}: test files {missing} do not exist; fix EXTRA_TESTS in {__file__}")
    if not tests:
        raise SystemExit(f"error: {source} has no tests; add its test files to EXTRA_TESTS in {__file__}")
    return sorted(set(tests))


def mutmut_section(source: str, tests: list[str]) -> str:
    """The ``[tool.mutmut]`` section that mutates ``source`` alone against ``tests``."""
    return "\n".join([
        "", "[tool.mutmut]",
        'source_paths = ["fedhet"]',
        f"only_mutate = [{json.dumps(source)}]",
        'pytest_add_cli_args = ["-n", "0", "-p", "no:cacheprovider", "-m", "not slow"]',
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        'process_isolation = "forkserver"', "",
    ])  # fmt: skip


#: test helpers every test file of algorithms/ may import: part of what a resumed workspace must not change
SHARED_TEST_FILES = ("tests/conftest.py", "tests/algorithms/conftest.py", "tests/algorithms/helpers.py",
                     "tests/algorithms/oracle.py")


def fingerprint(source: str) -> str:
    """SHA-256 over ``source`` and the test files its mutants run (a resumed workspace must match it)."""
    import hashlib

    digest = hashlib.sha256()
    for name in (source, *own_tests(source), *SHARED_TEST_FILES):
        path = ROOT / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"") + b"\0")
    return digest.hexdigest()


def resumable(source: str, base: Path) -> Path | None:
    """The kept workspace of ``source`` when it was made from the same source and tests, else None."""
    repo = base / source.replace("/", "__").removesuffix(".py") / "repo"
    stamp = repo.parent / "fingerprint"
    if not (repo / "mutants" / f"{source}.meta").exists() or not stamp.exists():
        return None
    return repo if stamp.read_text().strip() == fingerprint(source) else None


#: Appended to the workspace's ``tests/conftest.py``: a mutant's run stops at its first failing test
#: (``-x``), so the tests run in the order of their clean duration (mutmut's own stats), fastest
#: first. mutmut passes them in no particular order, and a file whose every function is reached by a
#: 50-second contract test spent most of a pass in it before the failing 0.1-second test. Only the
#: order changes: a survivor still runs every test that reaches its function.
FASTEST_FIRST = """

def pytest_collection_modifyitems(session, config, items):  # added by benchmarks/mutmut_score.py
    import json, os, pathlib

    stats = pathlib.Path("mutmut-stats.json")
    if os.environ.get("MUTANT_UNDER_TEST", "") in ("", "stats", "fail") or not stats.is_file():
        return
    durations = json.loads(stats.read_text())["duration_by_test"]
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))
"""


def workspace(source: str, base: Path) -> Path:
    """A fresh copy of the project with ``../shared`` linked beside it, set up to mutate ``source``."""
    slug = source.replace("/", "__").removesuffix(".py")
    repo = base / slug / "repo"
    shutil.rmtree(base / slug, ignore_errors=True)
    repo.mkdir(parents=True)
    for name in COPIED:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(ROOT / name, repo / name)
    if (ROOT.parent / "shared").exists():
        (repo.parent / "shared").symlink_to(ROOT.parent / "shared")
    for cache in repo.rglob("__pycache__"):
        shutil.rmtree(cache)
    with open(repo / "pyproject.toml", "a") as pyproject:
        pyproject.write(mutmut_section(source, own_tests(source)))
    with open(repo / "tests" / "conftest.py", "a") as conftest:
        conftest.write(FASTEST_FIRST)
    (repo.parent / "fingerprint").write_text(fingerprint(source) + "\n")
    return repo


def statuses(repo: Path, source: str) -> dict[str, str]:
    """Mutmut's status of every mutant of ``source``, by mutant name."""
    from mutmut.stats import status_by_exit_code

    meta = json.loads((repo / "mutants" / f"{source}.meta").read_text())
    return {name: status_by_exit_code[code] for name, code in meta["exit_code_by_key"].items()}


def show(repo: Path, name: str) -> str:
    """The diff of one mutant, as ``mutmut show`` prints it (changed lines only)."""
    out = subprocess.run(["mutmut", "show", name], cwd=repo, capture_output=True, text=True).stdout
    return "\n".join(line for line in out.splitlines()
                     if line[:1] in "+-" and not line.startswith(("+++", "---")))  # fmt: skip


#: Imports fedhet and the test files in "stats" mode and prints the functions of the mutated file
#: that ran while importing (run in a fresh interpreter in the workspace's ``mutants/``).
IMPORT_PROBE = """
import importlib, json, os, pkgutil, sys
os.environ["MUTANT_UNDER_TEST"] = "stats"
import mutmut.mutation.trampoline as trampoline
hits = set()
trampoline.record_trampoline_hit = lambda name, caller=None: hits.add(name)
import fedhet
for module in pkgutil.walk_packages(fedhet.__path__, "fedhet."):
    if module.name.endswith("__main__"):  # runs the command line
        continue
    try:
        importlib.import_module(module.name)
    except ImportError:  # an optional package (Ray, W&B's sweeps) that is not installed
        pass
for test_file in sys.argv[1:]:
    importlib.import_module(test_file.removesuffix(".py").replace("/", "."))
print(json.dumps(sorted(hits)))
"""


def import_time_functions(repo: Path, tests: list[str]) -> set[str]:
    """The functions of the mutated file that run while fedhet and its tests are imported.

    mutmut activates a mutant in a process forked from a server that has already imported the
    project, so a mutant of such a function (a class's ``__init_subclass__`` hook, a property
    factory called in a class body) never runs: mutmut reports it as surviving whatever the tests
    check. These survivors are checked again in a fresh interpreter (``recheck_in_fresh_interpreter``).
    """
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo / "mutants")}
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE, *tests], cwd=repo / "mutants", env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return set(json.loads(out.splitlines()[-1]))


def recheck_in_fresh_interpreter(repo: Path, tests: list[str], names: list[str], timeout: float,
                                 workers: int = 1) -> dict[str, str]:  # fmt: skip
    """Run each mutant's tests in a fresh interpreter started with the mutant active; its status by name.

    A failing test (or a collection error: the mutant breaks an import) kills it; a run past
    ``timeout`` counts as a timeout, as mutmut counts one; a passing run survives. The tests run
    fastest first (:data:`FASTEST_FIRST`); ``workers`` interpreters run at once (``--max-children``).
    """
    from concurrent.futures import ThreadPoolExecutor

    def status(name: str) -> str:
        env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "MUTANT_UNDER_TEST": name, "PYTHONPATH": str(repo / "mutants")}  # fmt: skip
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not slow",
                   *tests]  # fmt: skip
        try:
            code = subprocess.run(command, cwd=repo / "mutants", env=env, capture_output=True,
                                  timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return "timeout"
        return "survived" if code == 0 else "no tests" if code == 5 else "killed"

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, pool.map(status, names), strict=True))


def score(entry: dict) -> float | None:
    """Killed / (killed + survived - equivalent), timeouts counted as killed, 'no tests' as survived."""
    counts = entry["counts"]
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    survived = counts.get("survived", 0) + counts.get("no tests", 0) - len(entry.get("equivalent", {}))
    return None if killed + survived == 0 else killed / (killed + survived)


def defines_functions(source: str) -> bool:
    """Whether ``source`` has a function or method body (a file of declarations gives mutmut nothing)."""
    import ast

    tree = ast.parse((ROOT / source).read_text())
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(tree))


def run_file(source: str, base: Path, max_children: int, minutes: float | None = None,
             resume: bool = False) -> dict:  # fmt: skip
    """Run mutmut over ``source`` against its own tests; return counts, survivors and their diffs.

    With ``minutes``, mutmut is stopped after that long and the entry says how many mutants are
    decided (``partial``); the workspace stays for ``resume``. A resumed file adds the seconds of
    its earlier chunks.
    """
    if not defines_functions(source):  # mutmut mutates function bodies only, and exits 1 finding none
        return judged({"tests": own_tests(source), "counts": {}, "seconds": 0.0, "survivors": {},
                       "note": "no function: declarations only, nothing to mutate",
                       "tool": f"mutmut {MUTMUT_VERSION}", "date": time.strftime("%Y-%m-%d")})  # fmt: skip
    kept = resumable(source, base) if resume else None
    repo = kept or workspace(source, base)
    earlier = float((repo.parent / "seconds").read_text()) if kept and (repo.parent / "seconds").exists() else 0.0
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    with open(repo.parent / "mutmut.log", "a") as log:
        process = subprocess.Popen(["mutmut", "run", "--max-children", str(max_children)], cwd=repo, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            returncode = process.wait(timeout=None if minutes is None else minutes * 60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # mutmut and the forkserver's children; its meta keeps what it decided
            process.wait()
            returncode = None
    seconds = earlier + time.perf_counter() - started
    (repo.parent / "seconds").write_text(f"{seconds:.1f}\n")
    meta = repo / "mutants" / f"{source}.meta"
    if returncode is None:
        decided = sum(status != "not checked" for status in statuses(repo, source).values()) if meta.exists() else 0
        total = len(statuses(repo, source)) if meta.exists() else 0
        return {"partial": True, "decided": decided, "total": total, "seconds": round(seconds, 1),
                "next": f"python benchmarks/mutmut_score.py {source} --resume"}  # fmt: skip
    if returncode != 0 or not meta.exists():
        tail = (repo.parent / "mutmut.log").read_text()[-2000:]
        return {"error": f"mutmut exited {returncode}", "log_tail": tail, "seconds": round(seconds, 1)}
    by_name = statuses(repo, source)
    tests = own_tests(source)
    function = {name: name.rpartition("__mutmut_")[0] for name in by_name}
    import_time = import_time_functions(repo, tests)
    rechecked = [name for name, status in sorted(by_name.items())
                 if status in ("survived", "no tests") and function[name] in import_time]  # fmt: skip
    fresh = recheck_in_fresh_interpreter(repo, tests, rechecked, timeout=FRESH_TIMEOUT_S, workers=max_children)
    by_name.update(fresh)
    counts: dict[str, int] = {}
    for status in by_name.values():
        counts[status] = counts.get(status, 0) + 1
    survivors = {name: show(repo, name) for name, status in sorted(by_name.items())
                 if status in ("survived", "no tests")}  # fmt: skip
    seconds = earlier + time.perf_counter() - started  # with the fresh-interpreter rechecks
    entry = {"tests": tests, "counts": counts, "seconds": round(seconds, 1),
             "fresh_interpreter": {"functions": sorted(import_time & set(function.values())), "statuses": fresh},
             "survivors": survivors, "tool": f"mutmut {MUTMUT_VERSION}", "date": time.strftime("%Y-%m-%d"),
             **({"chunks": True} if kept else {})}
    return judged(entry)


def judged(entry: dict) -> dict:
    """``entry`` with its survivors judged by today's rules (``equivalent``, with reasons) and its score."""
    if "error" in entry or entry.get("partial"):
        return entry
    reasons = {name: equivalence_reason(name, diff) for name, diff in entry["survivors"].items()}
    entry["equivalent"] = {name: reason for name, reason in reasons.items() if reason}
    entry["score"] = score(entry)
    return entry


def goal(source: str) -> float:
    """The score the oracle-tests issue asks of ``source``."""
    return 0.9 if source.startswith("fedhet/functional/") or Path(source).name in SEED_FILES else 0.8


def report(results: dict) -> str:
    """The markdown tables of docs/mutation_score.md: the score per file, the equivalent survivors by reason."""
    lines = ["| file | mutants | killed | timeout | survived | no tests | equivalent | score | goal |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for source, entry in sorted(results.items()):
        if "error" in entry:
            lines.append(f"| `{source}` | {entry['error']} | | | | | | | |")
            continue
        if entry.get("partial"):
            lines.append(f"| `{source}` | {entry['total']} (in chunks: {entry['decided']} decided so far) "
                         "| | | | | | not yet | |")
            continue
        counts, value = entry["counts"], entry["score"]
        shown = "n/a" if value is None else f"{100 * value:.0f}%"
        mark = "" if value is None or value >= goal(source) else " (below)"
        lines.append(f"| `{source}` | {sum(counts.values())} | {counts.get('killed', 0)} | {counts.get('timeout', 0)} "
                     f"| {counts.get('survived', 0)} | {counts.get('no tests', 0)} | {len(entry['equivalent'])} "
                     f"| {shown}{mark} | {100 * goal(source):.0f}% |")  # fmt: skip
    reasons: dict[str, int] = {}
    for entry in results.values():
        for reason in entry.get("equivalent", {}).values():
            reasons[reason] = reasons.get(reason, 0) + 1
    lines += ["", "Surviving mutants judged equivalent, by reason:", "", "| mutants | reason |", "|---|---|"]
    lines += [f"| {count} | {reason.replace('|', chr(92) + '|')} |"
              for reason, count in sorted(reasons.items(), key=lambda item: -item[1])]  # fmt: skip
    return "\n".join(lines)


def load(path: Path) -> dict:
    """The results recorded so far (none when the file does not exist yet)."""
    return json.loads(path.read_text()) if path.exists() else {}


def save(path: Path, results: dict) -> None:
    """Write atomically: a killed run never leaves a truncated results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    partial.replace(path)


def main() -> None:
    """Run the files asked for (or print the report or the survivors of one file)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="source files under fedhet/algorithms or fedhet/functional")
    parser.add_argument("--all", action="store_true", help="every file of the mutated folders")
    parser.add_argument("--skip-done", action="store_true", help="leave out files already in --out")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/results/mutmut_score.json")
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once (one per core)")
    parser.add_argument("--report", action="store_true", help="print the markdown table of --out and stop")
    parser.add_argument("--minutes", type=float, help="stop each file after this long; --resume goes on")
    parser.add_argument("--resume", action="store_true",
                        help="go on in a file's kept workspace (same source and tests), else start it afresh")
    parser.add_argument("--workspace", type=Path, default=ROOT / "runs" / "mutmut",
                        help="where the files' workspaces are built and kept between chunks")
    parser.add_argument("--survivors", metavar="FILE", 
                        help="print the surviving mutants of FILE not judged equivalent and stop")
    args = parser.parse_args()
    results = {source: judged(entry) for source, entry in load(args.out).items()}
    if args.report:
        print(report(results))
        return
    if args.survivors:
        entry = results.get(args.survivors, {"survivors": {}, "equivalent": {}})
        for name, diff in entry["survivors"].items():
            if name not in entry["equivalent"]:
                print(f"## {name}\n{diff}\n")
        print(f"({len(entry['equivalent'])} more judged equivalent)")
        return
    try:
        import mutmut
    except ImportError:
        sys.exit(f"error: mutmut is not installed; run `pip install mutmut=={MUTMUT_VERSION}`")
    if getattr(mutmut, "__version__", MUTMUT_VERSION) != MUTMUT_VERSION:
        sys.exit(f"error: mutmut {mutmut.__version__} is installed; the scores are for {MUTMUT_VERSION}: "
                 f"run `pip install mutmut=={MUTMUT_VERSION}`")  # fmt: skip
    files = source_files() if args.all else args.files
    unknown = [f for f in files if f not in source_files()]
    if unknown or not files:
        sys.exit(f"error: {unknown or 'no files'}: name files under {' or '.join(MUTATED)}, or pass --all")
    if args.skip_done:
        files = [f for f in files if f not in results or results[f].get("partial")]
    for source in files:
        entry = run_file(source, args.workspace, args.max_children, args.minutes, args.resume)
        results[source] = entry
        save(args.out, results)
        if entry.get("partial"):
            print(f"{source}: stopped after {args.minutes} min, {entry['decided']} of {entry['total']} mutants "
                  f"decided; go on with '{entry['next']}'", flush=True)  # fmt: skip
            continue
        if "error" not in entry:
            shutil.rmtree(args.workspace / source.replace("/", "__").removesuffix(".py"), ignore_errors=True)
        shown = entry.get("error") or f"{entry['counts']} score {entry['score']}"
        print(f"{source}: {shown} ({entry['seconds']} s)", flush=True)


if __name__ == "__main__":
    main()
