"""A stock ``LightningCLI`` over any fedhet client module and one scenario client's data.

fedhet's client modules are ordinary LightningModules with typed ``__init__`` arguments, and a
scenario client's data is a LightningDataModule (:class:`fedhet.data.ClientDataModule`), so
Lightning's own CLI trains, validates, tests and checkpoints them with nothing fedhet-specific::

    python -m fedhet.examples.reuse_cli fit --config my_client.yaml

``--model`` takes any :class:`~fedhet.algorithms.base.ClientModule` subclass by class path
(``fedhet.algorithms.fedprox.FedProxClient``), ``--model.model`` a backbone class with a typed
``__init__`` (``fedhet.models.cnn.TinyCNN``). ``docs/reuse.md`` has a complete config.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI

from fedhet.algorithms.base import ClientModule
from fedhet.data import ClientDataModule


def main(args: Sequence[str] | None = None) -> LightningCLI:
    """Run Lightning's CLI (``fit``, ``validate``, ``test``, ``predict``) on ``args`` (default: ``sys.argv``)."""
    return LightningCLI(
        ClientModule,
        ClientDataModule,
        subclass_mode_model=True,
        args=list(args) if args is not None else None,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
