"""The one exception type the CLI turns into a single line on stderr.

Anything raised as :class:`KvcliError` is the user's problem to fix (a missing file, an
unknown method, a budget that cannot hold the sinks); anything else is a bug and keeps
its traceback.
"""


class KvcliError(Exception):
    """A problem with the user's input or environment, reported as one line."""


class UsageError(KvcliError):
    """Bad arguments: the CLI exits with code 2, as Typer does for its own usage errors."""
