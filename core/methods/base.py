"""What a method provides: its spec section, its compiled plan and its drafter."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ..machine import Plan
from ..models.config import ModelConfig
from ..request import Request
from ..spec import SpeculativeSpec

if TYPE_CHECKING:
    from draftline.core.contract import DraftRows, KVStore, Proposal

    from ..models.target import TargetModel


class Drafter(ABC):
    """Per-round drafting for a batch; per-request state lives in ``req.draft_state``.

    A drafter whose ``propose`` reads only ``rows`` (device tensors) and whose KV goes through
    the lent store sets ``graph_safe``: a backend may then capture its draft step in a graph,
    and call ``extend_rows`` instead of ``extend`` after each round.
    """

    graph_safe: ClassVar[bool] = False
    # propose() reads rows.features: the target's tapped features at each row's last verified
    # position (start - 1), which the backend keeps, so the drafter need not.
    reads_last_features: ClassVar[bool] = False
    # extend_rows() reads rows.features too (an entry at position t takes the features at t):
    # a backend resuming a prompt part-way (a later chunk, a prefix-cache hit) must supply them
    extends_from_features: ClassVar[bool] = False

    @abstractmethod
    def extend(self, req: Request, features: Tensor | None, first_position: int) -> None:
        """Take the target's tapped features [n, taps*H] for positions first_position.. onward:
        the whole prompt after prefill, then the accepted positions after each round."""

    @abstractmethod
    def propose(self, reqs: list[Request], rows: "DraftRows") -> "Proposal":
        """Draft K tokens after each request's last token (``rows`` holds the same facts as
        tensors; a graph-safe drafter reads only those)."""

    def extend_rows(self, rows: "DraftRows", features: Tensor, tokens: Tensor) -> None:
        """Graph-safe form of ``extend`` for stores that index KV by absolute position: take the
        features [N, W, taps*H] of all W verified positions from ``rows.start`` and the window's
        tokens [N, W] (the last token, then the drafts). Those past a row's accepted run are
        never read: the next round writes its own K/V over them."""
        raise NotImplementedError(f"{type(self).__name__} has no graph-safe extend")

    def admit(self, req: Request) -> None:
        """Take what the request's drafting state needs before its prefill (a cache slot of
        the lent store), for backends that prefill through ``prefill_rows``."""

    def prefill_rows(self, rows: "DraftRows", features: Tensor, ids: Tensor) -> None:
        """Graph-safe form of ``extend`` after a batched prefill: each row's prompt, right-
        padded, at positions 0 .. P - 1 (``rows.start`` is 0): its features [N, P, taps*H] and
        ids [N, P]. What lies past a row's prompt is never read: its first round writes over it.
        By default a round's update over the whole window."""
        self.extend_rows(rows, features, ids)

    def release(self, req: Request) -> None:
        req.draft_state = None


class Method(ABC):
    name: ClassVar[str]
    config_model: ClassVar[type[SpeculativeSpec]]

    def __init__(self, cfg: SpeculativeSpec):
        self.cfg = cfg

    @abstractmethod
    def plan(self, target: ModelConfig) -> Plan: ...

    def build_drafter(
        self, plan: Plan, target: "TargetModel", kv: "KVStore", device: torch.device, dtype: torch.dtype
    ) -> Drafter | None:
        return None
