"""One base class for every user-facing error of the core, so callers (CLI, verl start-up) can
report it as a clear message instead of a traceback."""


class TailSieveError(ValueError):
    """Bad input or an impossible setting; the message says what is wrong and how to fix it."""
