"""User-facing errors.

A `PipelineError` is a problem with the user's input or setup, not a bug: the CLI prints its message
as one paragraph (no traceback unless --debug) and exits non-zero. Messages name the thing, the bad
value, what is allowed and the fix.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Bad input or configuration; the message is complete and meant for the user."""

    def __init__(self, message: str):
        # One paragraph, whatever the underlying library put in its own message.
        super().__init__(" ".join(str(message).split()))


class ConfigError(PipelineError):
    """The configuration (TOML file or flags) is invalid."""


class DataError(PipelineError):
    """A Parquet shard or a value in it does not match what the configuration promises."""
