"""fedhet: a PyTorch Lightning experiment platform for heterogeneous federated learning.

Importing the package has no side effects: no file I/O, no logging configuration, no network.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
