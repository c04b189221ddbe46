"""The communication ledger: bytes up and down per round, measured from the payloads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CommunicationLedger:
    """Accumulates measured payload sizes.

    ``bytes_up`` counts what clients send (uploads, and the client side of collaborative
    exchanges); ``bytes_down`` what they receive. Downloads are counted once per receiving
    client: a broadcast to ten clients costs ten times its size.
    """

    total_up: int = 0
    total_down: int = 0
    round_up: int = 0
    round_down: int = 0
    per_round: list[dict[str, int]] = field(default_factory=list)

    def start_round(self) -> None:
        self.round_up = 0
        self.round_down = 0

    def record_up(self, nbytes: int) -> None:
        self.round_up += int(nbytes)

    def record_down(self, nbytes: int) -> None:
        self.round_down += int(nbytes)

    def end_round(self, round_idx: int, participants: int) -> dict[str, float]:
        """Close the round and return its ``comm/`` metrics."""
        self.total_up += self.round_up
        self.total_down += self.round_down
        self.per_round.append({"round": round_idx, "up": self.round_up, "down": self.round_down})
        share = max(participants, 1)
        return {
            "comm/bytes_up": float(self.round_up),
            "comm/bytes_down": float(self.round_down),
            "comm/bytes_up_per_client": self.round_up / share,
            "comm/bytes_down_per_client": self.round_down / share,
            "comm/bytes_up_total": float(self.total_up),
            "comm/bytes_down_total": float(self.total_down),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"total_up": self.total_up, "total_down": self.total_down, "per_round": list(self.per_round)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total_up = int(state["total_up"])
        self.total_down = int(state["total_down"])
        self.per_round = [dict(r) for r in state["per_round"]]
