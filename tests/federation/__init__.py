"""Tests of the round loop, client runtime, state stores and payload noise."""
