"""What ``trainer.memory_format: channels_last`` buys on this CPU, against contiguous (NCHW) weights.

For every model of the 28-pixel CPU family ``vtc_mnist5`` (which holds the main job's ``cpu4``),
a plain cross-entropy step and FedVTC's alternating step are timed twice in the same process:
with the module as built (contiguous) and laid out channels-last by
:func:`fedhet.federation.trainer.apply_memory_format`, as a run with
``--trainer.memory_format channels_last`` does. The steps are those of
``benchmarks/fedvtc_step.py`` (28x28 inputs, batch 16, the p = 980 neck, a plain Lightning
``Trainer`` after a warm-up fit). Times are per step, one intra-op thread by default, as the
configs' worker processes run. Record results in docs/performance.md ("Memory format").

Run: ``python benchmarks/memory_format.py [--steps 40] [--threads 1] [--models ...]``. The last
line printed is ``speedup <geometric mean over all rows of contiguous / channels-last time>``.
"""

from __future__ import annotations

import math

from fedvtc_step import seconds_per_step, step_timing_setup


def main() -> None:
    """Time each step in both layouts and print the ratios."""
    args = step_timing_setup(__doc__.splitlines()[0], steps=40)
    print(f"{'model':18s} {'step':7s} {'contiguous ms':>14s} {'channels_last ms':>17s} {'speedup':>8s}")
    speedups = []
    for name in args.models:
        for kind in ("plain", "fedvtc"):
            contiguous = seconds_per_step(kind, name, args.steps, "contiguous")
            channels_last = seconds_per_step(kind, name, args.steps, "channels_last")
            speedups.append(contiguous / channels_last)
            print(f"{name:18s} {kind:7s} {contiguous * 1e3:14.2f} {channels_last * 1e3:17.2f} {speedups[-1]:8.2f}")
    print(f"speedup {math.exp(sum(map(math.log, speedups)) / len(speedups)):.2f}")


if __name__ == "__main__":
    main()
