"""The verl.plugins entry point registers everything, and a broken plugin is reported loudly."""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

import pytest


def test_entry_point_registers_trainer_mode_replica_and_agent_loop():
    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("tailsieve") == "tailsieve_verl.integration.plugin"
    import verl  # noqa: F401  (loads the plugins)
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.workers.rollout.replica import get_rollout_replica_class

    from tailsieve_verl.integration.trainer import TailSieveTrainer

    assert get_trainer_cls("tailsieve") is TailSieveTrainer
    assert get_rollout_replica_class("tailsieve_sim").__name__ == "SimReplica"
    assert "tailsieve_agent" in _agent_loop_registry


def test_plugin_loads_cleanly_in_a_fresh_interpreter():
    """What every Ray worker does: `import verl` first (the entry point runs inside it); an import
    cycle there only shows in a fresh process."""
    import subprocess
    import sys

    code = ("import verl\n"
            "from verl.trainer.ppo.v1 import get_trainer_cls\n"
            "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry\n"
            "assert get_trainer_cls('tailsieve').__name__ == 'TailSieveTrainer'\n"
            "assert 'tailsieve_agent' in _agent_loop_registry\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "plugin failed to load" not in proc.stderr


def test_a_plugin_import_failure_is_logged_at_error(monkeypatch, caplog):
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import tailsieve_verl.integration.plugin as plugin

    def broken(*args, **kwargs):
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(RolloutReplicaRegistry, "register", broken)
    with caplog.at_level(logging.ERROR, logger="tailsieve_verl"), pytest.raises(RuntimeError):
        importlib.reload(plugin)
    assert any("tailsieve-verl plugin failed to load" in r.getMessage() and r.levelno == logging.ERROR
               for r in caplog.records)
