"""Building blocks several methods share, so that no method file imports another.

Every file directly in ``fedhet/algorithms/`` besides ``base.py`` is one method's; what two of
them use lives here, one place for each:

* :mod:`fedhet.algorithms.shared.common`: weight sharing (FedAvg's family), per-parameter client
  state, class statistics and prototype servers, lock-step public-data distillation, clients
  with auxiliary models;
* :mod:`fedhet.algorithms.shared.generators`: what FedMD-CG and FedCG share (per-client
  conditional generators and their server);
* :mod:`fedhet.algorithms.shared.cross_correlation`: the lock-step collaboration FCCL and FCCL+
  share.

Modules here import :mod:`fedhet.algorithms.base` and each other, never a method file. The
package itself imports nothing, so importing one of them loads only what it needs.
"""
