"""One base class for every user-facing error of the core, so callers (CLI, verl start-up) can
report it as a clear message instead of a traceback."""

from contextlib import contextmanager


class TailSieveError(ValueError):
    """Bad input or an impossible setting; the message says what is wrong and how to fix it."""


class MissingPackageError(TailSieveError):
    """An optional package a feature needs is not installed."""


@contextmanager
def needs_package(name: str, purpose: str, install: str | None = None):
    """Imports inside the block that ``purpose`` needs: a failed one becomes one line naming the
    package ``name`` (its import name) and the command that installs it, not a traceback."""
    try:
        yield
    except ImportError as e:
        missing = (e.name or "").partition(".")[0] == name
        why = "not installed" if missing else f"it fails to import: {' '.join(str(e).split()) or type(e).__name__}"
        raise MissingPackageError(f"{purpose} needs the {name} package ({why}); install it with: "
                                  f"{install or 'pip install ' + name}") from None
