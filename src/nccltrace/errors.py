"""Errors shared by the analysis and the emulator (kept here so neither imports the other)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An invalid configuration value. ``field`` names the option, ``message`` says how to fix it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")
