"""Tests of the data layer: embedded datasets, partitioners, scenarios and tensor loaders."""
