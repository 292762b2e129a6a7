"""User-facing errors.

Anything raised as a `UserError` is printed by the CLI as one line (no traceback) and
exits non-zero. The message must name the culprit: the flag, the file, or file:line.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for; the message says what and where."""


class ConfigError(UserError):
    """A bad flag, YAML value or combination of settings."""


class DataError(UserError):
    """A bad input data file; `where` is 'path' or 'path:line'."""

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # picklable across process pools (two-argument constructor)
        return (type(self), (self.where, self.message))
