"""Range-restricted hyperparameter types for typed ``__init__`` signatures.

A learning rate of ``-0.1`` or a negative loss weight used to be accepted by the parser and fail
(or, worse, train silently) minutes later, after the run directory and the W&B run existed.
Annotating an argument with one of these types makes jsonargparse reject a bad value when the
config is parsed, before anything is written, with the key, the value and the allowed range::

    def __init__(self, lam: NonNegativeFloat = 0.1, lr: PositiveFloat = 0.01) -> None: ...

At run time they are jsonargparse's restricted number types (``float``/``int`` subclasses, so
defaults and plain Python callers passing a float keep working: annotations are not enforced
outside the parser). Static type checkers see plain ``float``/``int``, so ``FedProto(lam=0.5)``
type-checks. Which type to pick:

- :data:`PositiveFloat` (``> 0``): learning rates, temperatures, scales, kernel bandwidths.
- :data:`NonNegativeFloat` (``>= 0``): loss weights, lambdas, ``mu``, weight decay, noise.
- :data:`UnitInterval` (``[0, 1]``): probabilities, fractions, mixing and EMA coefficients.
- :data:`Fraction` (``(0, 1]``): a share that must not be empty (clients per round, batches).
- :data:`Momentum` (``[0, 1)``): SGD momentum.
- :data:`PositiveInt` (``>= 1``): counts, epochs, steps, batch sizes, dimensions.
- :data:`NonNegativeInt` (``>= 0``): counts that may be zero (warm-up rounds, pretraining epochs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    PositiveFloat = float
    NonNegativeFloat = float
    UnitInterval = float
    Fraction = float
    Momentum = float
    PositiveInt = int
    NonNegativeInt = int
else:
    from jsonargparse.typing import (
        ClosedUnitInterval as UnitInterval,
    )
    from jsonargparse.typing import (
        NonNegativeFloat,
        NonNegativeInt,
        PositiveFloat,
        PositiveInt,
        restricted_number_type,
    )

    Fraction = restricted_number_type("Fraction", float, [(">", 0), ("<=", 1)])
    Momentum = restricted_number_type("Momentum", float, [(">=", 0), ("<", 1)])

#: The allowed range of each type, as the one-line errors of the command line word it.
RANGES: dict[str, str] = {
    "PositiveFloat": "a number > 0",
    "NonNegativeFloat": "a number >= 0",
    "ClosedUnitInterval": "a number in [0, 1]",
    "OpenUnitInterval": "a number in (0, 1)",
    "Fraction": "a number in (0, 1]",
    "Momentum": "a number in [0, 1)",
    "PositiveInt": "an integer >= 1",
    "NonNegativeInt": "an integer >= 0",
}


def plain(value: Any) -> Any:
    """``value`` with jsonargparse's range-checked numbers (also in a list or tuple) as plain ``float``/``int``.

    They behave as numbers, but pickled into a checkpoint (a module's saved hyperparameters, a
    server's state) they would not load under ``torch.load(weights_only=True)``.
    """
    if type(value).__module__ == "jsonargparse.typing":
        return float(value) if isinstance(value, float) else int(value)
    if isinstance(value, (list, tuple)) and any(type(v).__module__ == "jsonargparse.typing" for v in value):
        return type(value)(plain(v) for v in value)
    return value


__all__ = [
    "RANGES",
    "Fraction",
    "Momentum",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "UnitInterval",
    "plain",
]
