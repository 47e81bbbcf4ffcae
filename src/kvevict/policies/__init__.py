"""Eviction policies: pure scoring over small tensors, one file each."""

from .base import AttentionRequest, Policy, SlotView
from .registry import known_specs, parse_policy, register

__all__ = ["AttentionRequest", "Policy", "SlotView", "known_specs", "parse_policy", "register"]
