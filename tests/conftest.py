"""Shared pytest settings: plots render off-screen; the repository root is importable."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
