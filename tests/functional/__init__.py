"""Tests of the pure loss and aggregation functions against hand-computed values."""
