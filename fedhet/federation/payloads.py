"""Payload types, kept importable from their old place; they live in :mod:`fedhet.core.payloads`."""

from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload, check_shape

__all__ = ["ClassStatsPayload", "Payload", "WeightsPayload", "check_shape"]
