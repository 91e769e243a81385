"""verl 0.9.1 integration: TailSieve trainer mode, pool router, agent-loop manager, simulated
rollout backend, per-pool engine config, metrics. Imported by verl through the ``verl.plugins``
entry point (``tailsieve_verl.integration.plugin``)."""

