"""Eviction policies: pure scoring over small tensors, one file each."""

from .base import AttentionRequest, Policy, QueryBatch, SlotView
from .registry import REGISTRY, check_policy, is_full_cache, known_specs, parse_policy, register, shared_batches
from .sinks import SinkWrapper

__all__ = [
    "REGISTRY",
    "AttentionRequest",
    "Policy",
    "QueryBatch",
    "SinkWrapper",
    "SlotView",
    "check_policy",
    "is_full_cache",
    "known_specs",
    "parse_policy",
    "register",
    "shared_batches",
]
