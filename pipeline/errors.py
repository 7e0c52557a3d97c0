"""User-facing errors.

A `PipelineError` is a problem with the user's input or setup, not a bug: the CLI prints its message
as one paragraph (no traceback unless --debug) and exits non-zero. Messages name the thing, the bad
value, what is allowed and the fix.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Bad input or configuration; the message is complete and meant for the user.

    details: where it happened, for --debug (e.g. the traceback of a task on another node)."""

    def __init__(self, message: str, details: str = ""):
        # One paragraph, whatever the underlying library put in its own message.
        super().__init__(" ".join(str(message).split()))
        self.details = details

    def __reduce__(self):  # keep details when Ray pickles the error from a task or worker
        return type(self), (str(self), self.details)


class ConfigError(PipelineError):
    """The configuration (TOML file or flags) is invalid."""


class DataError(PipelineError):
    """A Parquet shard or a value in it does not match what the configuration promises."""


class NoUsableRows(DataError):
    """Every file or row group was set aside: the run stops, and its manifest is still written."""

    def __init__(self, message: str, manifest_jsonl: str = "", details: str = ""):
        super().__init__(message, details)
        self.manifest_jsonl = manifest_jsonl

    def __reduce__(self):
        return type(self), (str(self), self.manifest_jsonl, self.details)


class StallError(PipelineError):
    """A stage made no progress for run.stall_timeout_s: the message says what it waited for."""


def find_pipeline_error(e: BaseException | None) -> PipelineError | None:
    """Our error inside whatever Ray wrapped it in (task errors, UserCodeException, worker group
    failures), or None. Ray Data passes a task's exception on as text inside its own (the original
    object does not travel), so the last `pipeline.errors.X: message` line of that text counts too."""
    found = _find_object(e)
    if found is not None or e is None:
        return found
    import re

    hits = re.findall(r"pipeline\.errors\.(\w+): (.+)", str(e))
    kinds = {c.__name__: c for c in (PipelineError, ConfigError, DataError, StallError)}
    for name, message in reversed(hits):
        if name in kinds:
            return kinds[name](message, str(e))
    return None


def _find_object(e: BaseException | None) -> PipelineError | None:
    seen = set()
    stack = [e]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, PipelineError):
            return cur
        stack += [getattr(cur, "cause", None), cur.__cause__, cur.__context__,
                  getattr(cur, "_original_exception", None)]
        failures = getattr(cur, "worker_failures", None)
        if isinstance(failures, dict):
            stack += list(failures.values())
    return None
