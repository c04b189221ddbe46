"""Tests of the federated methods: one file per registered method plus cross-method contract tests."""
