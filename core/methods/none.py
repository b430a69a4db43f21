"""`none`: plain autoregressive decoding, the same machine with K = 0 (the baseline)."""

from __future__ import annotations

from typing import Literal

from ..machine import Plan
from ..models.config import ModelConfig
from ..registry import METHODS
from ..spec import SpeculativeSpec
from .base import Method


class NoneSpec(SpeculativeSpec):
    method: Literal["none"] = "none"


@METHODS.register("none")
class NoneMethod(Method):
    config_model = NoneSpec

    def plan(self, target: ModelConfig) -> Plan:
        return Plan(method="none", drafting="none", num_speculative_tokens=0)
