"""Errors shared by the analysis and the emulator (kept here so neither imports the other)."""

from __future__ import annotations

__all__ = ["ConfigError", "console_warnings"]


class ConfigError(ValueError):
    """An invalid configuration value. ``field`` names the option, ``message`` says how to fix it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def console_warnings() -> None:
    """Show this package's warnings (damaged or unexpected input, an untested export schema) as
    one line ``warning: <message>`` on stderr, as the console's other findings are, instead of
    Python's ``file:line: Category: message`` with a source line. Other packages' warnings keep
    Python's format."""
    import warnings

    default = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):  # type: ignore[no-untyped-def]
        if getattr(category, "__module__", "").startswith("nccltrace"):
            return f"warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = fmt
