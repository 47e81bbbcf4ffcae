"""CLI commands for the protocols beyond perplexity (needle, generation, sinks)."""

from __future__ import annotations

from .cli import app  # noqa: F401
