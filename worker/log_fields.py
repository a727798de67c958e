"""The worker's log lines: one line per event, its fields as key=value."""

from __future__ import annotations


def kv(**fields: object) -> str:
    """Log fields as key=value (logs are one line per event; prompts are never logged)."""
    return " ".join(f"{k}={v}" for k, v in fields.items())
