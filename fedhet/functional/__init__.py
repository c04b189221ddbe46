"""Pure tensor math shared by methods: no state, no I/O, each function tested against hand values."""

from fedhet.functional.aggregation import aggregate_class_means, weighted_average
from fedhet.functional.prototypes import class_means
from fedhet.functional.regularizers import proximal_term

__all__ = ["aggregate_class_means", "class_means", "proximal_term", "weighted_average"]
