"""The one exception type the CLI turns into a single line on stderr.

Anything raised as :class:`KvcliError` is the user's problem to fix (a missing file, an
unknown method, a budget that cannot hold the sinks); anything else is a bug and keeps
its traceback.
"""


class KvcliError(Exception):
    """A problem with the user's input or environment, reported as one line."""


class UsageError(KvcliError):
    """Bad arguments: the CLI exits with code 2, as Typer does for its own usage errors."""


class BudgetError(UsageError):
    """A budget too small for what a method always keeps.

    The library speaks of a budget; the CLI, which knows which flag set it, names the flag (see
    :meth:`for_flag`).
    """

    def __init__(self, budget: int, need: int, what: str):
        self.budget, self.need, self.what = budget, need, what
        super().__init__(f"a budget of {budget} tokens is smaller than {what} ({need})")

    def for_flag(self, flag: str) -> str:
        return f"{flag} {self.budget} is smaller than {self.what} ({self.need}): raise {flag} or lower them"


class UnsupportedModelError(KvcliError):
    """A model whose architecture kvcli cannot stream with re-assigned positions (no RoPE, unknown RoPE)."""


class EmptyDocumentError(KvcliError):
    """A document with nothing to read (or, to score, fewer than 2 tokens): a corpus skips it with a warning
    and a row saying so; a source of one document is an error."""

    def __init__(self, name: str, why: str = "is empty"):
        self.name, self.why = name, why
        super().__init__(f"input is empty: {name}" if why == "is empty" else f"{name} {why}")
