"""Payloads: everything that crosses the network between a client and the server.

A payload is a frozen dataclass whose fields are tensors (or dicts of tensors, or plain ints).
The round loop measures communication from :meth:`Payload.nbytes` (the bytes of the tensors as
they would be serialised), never from a formula, and validates every payload the server receives
with :meth:`Payload.validate` (floating dtypes, finite values, and the shapes the method
expects), so that one diverged or malicious client cannot silently poison an aggregate.

Methods reuse the payloads here when one fits and declare their own (in their own file) when
none does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedhet.errors import TrainingError


def _tensors(value: Any) -> Iterator[tuple[str, Tensor]]:
    if isinstance(value, Tensor):
        yield "", value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            for sub, tensor in _tensors(item):
                yield f".{key}{sub}", tensor
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            for sub, tensor in _tensors(item):
                yield f"[{index}]{sub}", tensor


@dataclass(frozen=True)
class Payload:
    """Base class of all payloads.

    Subclasses are frozen dataclasses. ``num_examples`` is the sender's number of training
    examples (Flower's weighting convention; 0 for server downloads). It is metadata and is not
    counted in :meth:`nbytes`.
    """

    num_examples: int = 0

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(name, tensor)`` for every tensor carried, nested containers included."""
        for field in dataclasses.fields(self):
            for sub, tensor in _tensors(getattr(self, field.name)):
                yield field.name + sub, tensor

    def nbytes(self) -> int:
        """Bytes of tensor data this payload puts on the wire."""
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    def validate(self, sender: str = "client") -> None:
        """Reject non-finite floating tensors and complex dtypes.

        Raises:
            TrainingError: naming the sender, the field and the problem.
        """
        for name, tensor in self.tensors():
            if tensor.is_complex():
                raise TrainingError(f"{sender} sent field '{name}' with unsupported dtype {tensor.dtype}")
        # the largest magnitude is NaN or inf exactly when some value is; the per-field search runs
        # only when it is
        if math.isfinite(self.largest_magnitude()):
            return
        name = next(n for n, t in self.tensors() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
        raise TrainingError(
            f"{sender} sent non-finite values in '{name}' (training diverged?); "
            "lower the learning rate or enable gradient clipping (--trainer.gradient_clip_val)"
        )

    def largest_magnitude(self) -> float:
        """The largest magnitude among the floating values carried (0 when there are none; NaN or inf if any is).

        Computed once per payload (one fused reduction over all tensors, accumulated in float64) and
        kept: a payload is frozen and the loop screens it several times (:meth:`validate`, the value
        bound, the server's own checks); its tensors are never changed in place once it is sent.
        """
        cached = self.__dict__.get("_largest_magnitude")
        if cached is None:
            floating = [t.detach() for _, t in self.tensors() if t.is_floating_point() and t.numel()]
            cached = (
                float(torch.stack(torch._foreach_norm(floating, float("inf"), dtype=torch.float64)).max())
                if floating
                else 0.0
            )
            self.__dict__["_largest_magnitude"] = cached
        return cached

    def check_value_bound(self, bound: float | None, sender: str = "client") -> float:
        """Refuse a payload carrying a value larger in magnitude than ``bound`` (``federation.upload_value_bound``).

        Returns:
            The largest magnitude (logged, so bounds can be chosen from data).

        Raises:
            TrainingError: one line naming the sender, the magnitude and the fix.
        """
        largest = self.largest_magnitude()
        if bound is not None and largest > bound:
            raise TrainingError(
                f"{sender} sent a value of magnitude {largest:.3g} (bound {bound:g}); "
                "a diverged or poisoned client, or raise federation.upload_value_bound"
            )
        return largest

    def map_tensors(self, fn: Callable[[str, Tensor], Tensor]) -> Payload:
        """Return a copy with every tensor replaced by ``fn(name, tensor)`` (names as :meth:`tensors`)."""

        def apply(name: str, value: Any) -> Any:
            if isinstance(value, Tensor):
                return fn(name, value)
            if isinstance(value, Mapping):
                return {k: apply(f"{name}.{k}", v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(apply(f"{name}[{i}]", v) for i, v in enumerate(value))
            return value

        return dataclasses.replace(
            self, **{f.name: apply(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}
        )

    def to(self, device: torch.device | str) -> Payload:
        """Return a copy with every tensor moved to ``device``."""
        return self.map_tensors(lambda _, tensor: tensor.to(device))


def check_shape(sender: str, name: str, tensor: Tensor, expected: tuple[int, ...]) -> None:
    """Raise a one-line :class:`TrainingError` when ``tensor`` does not have shape ``expected``."""
    if not isinstance(tensor, Tensor):
        raise TrainingError(f"{sender} sent '{name}' as {type(tensor).__name__}, expected a tensor")
    if tuple(tensor.shape) != tuple(expected):
        raise TrainingError(
            f"{sender} sent '{name}' of shape {tuple(tensor.shape)}, expected {tuple(expected)}; "
            "all clients must use the same num_classes / feature layout"
        )


@dataclass(frozen=True)
class WeightsPayload(Payload):
    """A model's (or a sub-module's) ``state_dict``: FedAvg, FedProx, LG-FedAvg heads ..."""

    weights: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def validate_against(self, reference: Mapping[str, Tensor], sender: str = "client") -> None:
        """Validate values, then keys, shapes and dtype kinds against a reference ``state_dict``."""
        self.validate(sender)
        check_like(sender, "weights", self.weights, reference, "the global model")


def check_like(
    sender: str,
    field: str,
    tensors: Mapping[str, Tensor],
    reference: Mapping[str, Tensor],
    of: str,
    what: str | None = None,
) -> None:
    """Raise a one-line :class:`TrainingError` unless ``tensors`` has ``reference``'s keys, shapes and dtype kinds.

    ``of`` names what the reference is ("the global model", "the model's parameters") and ``what``
    what was sent (default: the field's name) in the message.
    """
    if set(tensors) != set(reference):
        missing = sorted(set(reference) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(reference))[:3]
        raise TrainingError(
            f"{sender} sent {what or field} whose keys differ from {of} (missing {missing}, unexpected {extra}); "
            "all clients of an architecture must send the same layout"
        )
    for key, tensor in tensors.items():
        check_shape(sender, f"{field}.{key}", tensor, tuple(reference[key].shape))
        check_dtype(sender, f"{field}.{key}", tensor, reference[key].dtype, of)


def check_dtype(sender: str, name: str, tensor: Tensor, expected: torch.dtype, of: str = "the server") -> None:
    """Raise a one-line :class:`TrainingError` unless ``tensor`` has exactly dtype ``expected``.

    Exact, not just the same kind: a float16 upload averaged into a float32 model would either
    change the global model's dtype (``weighted_average`` casts to the first upload's dtype) or
    silently lose precision, so another precision is refused, never cast behind the user's back.
    """
    if tensor.dtype != expected:
        raise TrainingError(
            f"{sender} sent '{name}' as {tensor.dtype} where {of} holds {expected}; "
            "clients must send tensors in the server's dtype (same trainer.precision everywhere)"
        )


def check_tensor(
    sender: str, name: str, tensor: Tensor, shape: tuple[int, ...], dtype: torch.dtype, of: str = "the server"
) -> None:
    """Raise a one-line :class:`TrainingError` unless ``tensor`` has exactly ``shape`` and ``dtype``.

    The one check every server's :meth:`~fedhet.algorithms.base.ServerPhase.check_upload` applies
    to a tensor whose layout it knows from its own state or declared spec (never from another
    upload): a wrong shape would fail (or broadcast) inside the aggregate, another precision
    would change the server's dtype or silently lose precision (see :func:`check_dtype`).
    """
    check_shape(sender, name, tensor, shape)
    check_dtype(sender, name, tensor, dtype, of)


def check_counts(
    sender: str,
    name: str,
    counts: Tensor,
    length: int,
    held: Tensor | None = None,
    what: str = "class counts",
    exact: bool = True,
) -> None:
    """Raise a one-line :class:`TrainingError` unless ``counts`` are ``[length]`` non-negative int64 counts.

    Args:
        sender: who sent them, for the message.
        name: the payload field (for the shape message).
        counts: the counts sent.
        length: the entries expected (the server's class count).
        held: the sender's training examples per class, when the server knows them: a count
            above it is inconsistent (a statistic over more examples than the client has).
        what: what the counts are, for the message ("class counts", "label counts").
        exact: also require int64 (what every client sends); ``False`` accepts any integer dtype.
    """
    check_shape(sender, name, counts, (length,))
    wrong_kind = counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool
    if wrong_kind or (exact and counts.dtype != torch.long) or bool((counts < 0).any()):
        raise TrainingError(f"{sender} sent invalid {what} (must be non-negative integers, int64)")
    if held is not None and bool((counts.cpu() > held.cpu()).any()):
        c = int((counts.cpu() > held.cpu()).nonzero()[0, 0])
        raise TrainingError(
            f"{sender} sent {what} inconsistent with its data (class {c}: {int(counts[c])} "
            f"examples, it holds {int(held[c])})"
        )


def held_class_nbytes(counts: Tensor, *per_class: Tensor) -> int:
    """Wire bytes of per-class tensors when only the classes a sender holds are sent.

    ``per_class`` tensors have one leading row per class; a class counts when ``counts[c] > 0``,
    and each class sent carries its rows of every tensor plus its count. Rows of absent classes
    are zero placeholders that keep the tensors dense for aggregation, and are not sent.

    Example:
        >>> held_class_nbytes(torch.tensor([3, 0, 1]), torch.zeros(3, 2), torch.zeros(3, 2, 2))
        64
    """
    held = int((counts > 0).sum())
    row = sum(t[0].numel() * t.element_size() for t in per_class if t.numel())
    return held * (row + counts.element_size())


@dataclass(frozen=True)
class ClassStatsPayload(Payload):
    """Per-class statistics: prototypes (FedProto), average logits (FD), ETF-space prototypes ...

    ``values[c]`` is the mean over the sender's examples of class ``c``; ``counts[c]`` is how
    many examples that mean is over. Classes the sender does not hold have ``counts[c] == 0``
    and their row is ignored by every aggregation (their value is zero and carries no meaning).

    Only rows of classes held are sent, so :meth:`nbytes` counts ``values`` rows with a
    non-zero count plus one int64 count per class sent, matching how the papers count uploads.
    """

    values: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0))
    counts: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def nbytes(self) -> int:
        return held_class_nbytes(self.counts, self.values)

    def validate_shape(
        self,
        num_classes: int,
        dim: int | None,
        sender: str = "client",
        dtype: torch.dtype | None = None,
        held: Tensor | None = None,
    ) -> None:
        """Validate values, then ``values`` is ``[num_classes, dim]`` and counts are non-negative integers.

        Args:
            num_classes: the rows ``values`` and ``counts`` must have.
            dim: the columns ``values`` must have (``None``: any).
            sender: who sent it, for the message.
            dtype: the exact dtype ``values`` must have, and then ``counts`` must be int64 (what a
                server checking an upload asks); ``None``: any floating values, any integer counts.
            held: the sender's training examples per class, when the server knows them: a count
                above it is inconsistent (a statistic over more examples than the client has).
        """
        self.validate(sender)
        if self.values.dim() != 2:
            raise TrainingError(f"{sender} sent class statistics with {self.values.dim()} dims, expected 2")
        check_shape(sender, "values", self.values, (num_classes, dim if dim is not None else self.values.shape[1]))
        check_shape(sender, "counts", self.counts, (num_classes,))
        if not self.values.is_floating_point():
            raise TrainingError(f"{sender} sent class statistics as {self.values.dtype}; send floating values")
        if dtype is not None:
            check_dtype(sender, "values", self.values, dtype)
        check_counts(sender, "counts", self.counts, num_classes, held, exact=dtype is not None)
