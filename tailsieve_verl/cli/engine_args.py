"""Engine flags in vLLM's words (``--max-num-seqs``, ``--num-gpu-blocks``, ``--block-size``,
``--max-num-batched-tokens``, ``--num-speculative-tokens``, ``--spec-acceptance``,
``--spec-schedule``), shared by every subcommand that evaluates replicas: one
:class:`core.engine.engine.EngineConfig` for all of them. Without any flag the engine binds nothing
(today's model). The ``--spec-*`` flags also describe the speculation of ``simulate``'s speculation
policies (:data:`core.simulation.sim.SPEC_POLICIES`), MTP-like assumptions where a flag is not given.
``--spec-acceptance`` takes the numbers or a ``tailsieve calibrate`` file, whose measured acceptance
is used; the speculation policies' config records where its acceptance came from, and without a
measured or given one no speculation is recommended (:func:`acceptance_source`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.engine.engine import (H200_MODELS, TP_WIDTHS, EngineConfig, EngineConfigError, SpeculativeConfig,
                                  measured_engine_fields, parse_spec_schedule, prefill_cost_from_perf, single_widths)
from ..core.engine.perf import BUNDLED_TABLES, Calibration, PerfModel
from ..core.simulation.sim import DEFAULT_SPECULATION
from ..core.engine.verify_cost import VerifyTable
from .checks import MAX_COUNT, CLIError, FloatRule, IntRule

MAX_BLOCKS = 10 ** 9
FIELD_FLAGS = ("max_num_seqs", "num_gpu_blocks", "block_size", "max_num_batched_tokens")
"""Engine flags named after the :class:`core.engine.engine.EngineConfig` field they set."""


ENGINE_SHAPES = (*sorted(H200_MODELS), "auto", "none")
PLANNING_ENGINE = "auto"
"""The ``--engine-defaults`` of ``simulate``, ``plan`` and ``route``: verl 0.9.1's rollout defaults for the
``--perf-model``'s shape, so that the three price one step on the same engine."""


def add_engine_args(parser: argparse.ArgumentParser, defaults: str | None = None) -> None:
    """The engine flags; ``defaults``: the ``--engine-defaults`` a subcommand starts from (None: none)."""
    g = parser.add_argument_group(
        "engine (vLLM v1 scheduler; unset: no limit binds)" if defaults is None else
        f"engine (vLLM v1 scheduler; --engine-defaults {defaults} unless given)",
        "per-replica engine settings in vLLM's words; --engine-defaults gives verl 0.9.1's rollout defaults "
        "on one H200 and the flags below override them")
    g.add_argument("--engine-defaults", choices=ENGINE_SHAPES, metavar="MODEL", default=defaults,
                   help="verl 0.9.1's rollout defaults for this model shape on one H200 (max_num_seqs 256, "
                        "8192-token chunked prefill, prefix caching, KV cache at gpu_memory_utilization 0.5): "
                        + ", ".join(sorted(H200_MODELS)) + "; auto: the --perf-model's model where it is a bundled "
                        "H200 table (qwen3-1.7b for table:h200-dense), else none; none: no limit binds")
    g.add_argument("--max-num-seqs", type=IntRule(1, MAX_COUNT), help="requests running at once per replica; "
                   "the rest wait FIFO (verl: 256)")
    g.add_argument("--num-gpu-blocks", type=IntRule(1, MAX_BLOCKS),
                   help="KV-cache blocks per replica (vLLM --num-gpu-blocks-override); full blocks preempt the "
                        "newest running request, recomputed later")
    g.add_argument("--block-size", type=IntRule(1, 1024), help="tokens per KV block (default 16)")
    g.add_argument("--max-num-batched-tokens", type=IntRule(1, MAX_BLOCKS),
                   help="token budget per step with chunked prefill, prefill priced from --perf-model (verl: 8192)")
    g.add_argument("--num-speculative-tokens", type=IntRule(1, 64),
                   help="draft tokens verified per request per step (needs --spec-acceptance)")
    g.add_argument("--spec-acceptance", type=_acceptance, metavar="A1[,A2,...]|CAL.json",
                   help="acceptance of draft position 1, 2, ... given the earlier ones (the last repeats), or the "
                        "acceptance a `tailsieve calibrate` file measured (its k unless --num-speculative-tokens)")
    g.add_argument("--spec-schedule", type=_schedule, metavar="B1-B2:K,...",
                   help="vLLM dynamic SD: k by running batch size, e.g. 1-64:3,65-128:1,129-256:0")
    g.add_argument("--spec-draft-cost", type=FloatRule(0.0, 10.0, lo_open=False),
                   help="drafting cost per draft token as a fraction of a decode step (MTP ~ 1/layers; default 0, "
                        "for the speculation policies 1/28)")
    g.add_argument("--spec-verify-table", metavar="PATH[:MODEL]",
                   help="price verify steps with a measured verify cost (scripts/gpu/verify_cost.py's JSON; "
                        "`tailsieve verify-cost PATH` shows it) instead of the first-order "
                        "T(b(k+1),0)+T(b,c)-T(b,0)")
    g.add_argument("--spec-acceptance-half-life", type=FloatRule(0.0, 1e9), metavar="TOKENS",
                   help="context length over which acceptance halves (default: no decay)")



@dataclass(frozen=True)
class MeasuredAcceptance:
    """The per-position acceptance a ``tailsieve calibrate`` file measured (``--spec-acceptance CAL.json``)."""

    values: tuple[float, ...]
    k: int  # the deepest k the server drafted
    temperature: float | None  # the sampling temperature of the measurement (None: not recorded)
    path: str

    @property
    def source(self) -> str:
        at = "an unrecorded temperature" if self.temperature is None else f"T={self.temperature:g}"
        return f"measured by tailsieve calibrate at {at} ({self.path}, k={self.k})"


def measured_acceptance(path: str) -> MeasuredAcceptance:
    """The acceptance of a calibration's ``engine.speculative`` rows, pooled as the engine model reads it."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: cannot read the calibration ({exc})") from None
    facts = doc.get("engine") if isinstance(doc, dict) else None
    spec_facts = facts.get("speculative") if isinstance(facts, dict) else None
    if not spec_facts:
        raise argparse.ArgumentTypeError(f"{path} measured no speculation: run `tailsieve calibrate --temperature T` "
                                         "against a server started with a speculative_config")
    try:
        spec = measured_engine_fields({"speculative": spec_facts}, name=path)["speculative"]
    except (EngineConfigError, KeyError, TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: unreadable speculation rows ({exc})") from None
    temperature = spec_facts.get("temperature", (doc.get("plan") or {}).get("temperature"))
    return MeasuredAcceptance(spec.acceptance, spec.num_speculative_tokens,
                              None if temperature is None else float(temperature), path)


def _acceptance(text: str) -> tuple[float, ...] | MeasuredAcceptance:
    if text.endswith(".json") or Path(text).is_file():
        return measured_acceptance(text)
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated acceptances in [0, 1], got {text!r}") from None
    if not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"every acceptance must be in [0, 1], got {text!r}")
    return values


def _schedule(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        return parse_spec_schedule(text)
    except EngineConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config_from_args(args: argparse.Namespace, perf: PerfModel | None, spec_policies: bool = False
                            ) -> EngineConfig:
    """The engine the flags describe (``EngineConfig()`` without any). ``perf`` prices prefill (None:
    the limits alone, before a perf model exists, e.g. to size a calibration). ``spec_policies``:
    speculation policies run, so ``--spec-*`` flags without a depth describe only their speculation."""
    spec_flags = (args.spec_acceptance, args.spec_schedule, args.spec_draft_cost, args.spec_acceptance_half_life,
                  args.spec_verify_table)
    shape = engine_shape(args.engine_defaults, perf)
    width = getattr(args, "tensor_parallel_size", 1)
    if width != 1 and not shape:
        raise CLIError(f"--tensor-parallel-size {width} prices a wider replica from a bundled model shape; give "
                       "--engine-defaults MODEL (or a bundled --perf-model table)")
    try:
        base = (EngineConfig.verl_defaults(shape, perf, block_size=args.block_size or 16, tensor_parallel_size=width)
                if shape else EngineConfig())
    except EngineConfigError as exc:
        raise CLIError(f"--tensor-parallel-size {width}: {exc}") from None
    fields = {name: getattr(args, name) for name in FIELD_FLAGS if getattr(args, name) is not None}
    if args.max_num_batched_tokens is not None and not shape and perf is not None:
        fields["prefill_s_per_token"] = prefill_cost_from_perf(perf)
    k = args.num_speculative_tokens
    if k is None and args.spec_schedule:
        k = max(entry[2] for entry in args.spec_schedule)
    if k is None and isinstance(args.spec_acceptance, MeasuredAcceptance) and not spec_policies:
        k = args.spec_acceptance.k
    if k is None and any(v is not None for v in spec_flags) and not spec_policies:
        raise CLIError("--spec-acceptance/--spec-schedule/--spec-draft-cost/--spec-acceptance-half-life/"
                       "--spec-verify-table need "
                       "--num-speculative-tokens K (or a --spec-schedule with some K > 0)")
    if k is not None:
        if args.spec_acceptance is None:
            given = (f"--num-speculative-tokens {k}" if args.num_speculative_tokens is not None else
                     f"--spec-schedule (speculating up to k = {k})")
            raise CLIError(f"{given} needs --spec-acceptance A1[,A2,...] (per-position acceptance, e.g. 0.85,0.8, "
                           "or a `tailsieve calibrate` file)")
        if k == 0:
            raise CLIError("--spec-schedule has k = 0 everywhere: leave speculation off instead")
        fields["speculative"] = SpeculativeConfig(
            k, _acceptance_values(args.spec_acceptance), args.spec_schedule or (), args.spec_acceptance_half_life,
            args.spec_draft_cost or 0.0, _verify_table(args))
    return replace(base, **fields)


def add_width_arg(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size`` (``simulate``, ``plan``): the replicas' width; --replicas counts replicas."""
    parser.add_argument("--tensor-parallel-size", type=IntRule(1, max(TP_WIDTHS)), choices=TP_WIDTHS, default=1,
                        metavar="T",
                        help="GPUs per replica (verl: actor_rollout_ref.rollout.tensor_model_parallel_size), 1, 2, 4 "
                             "or 8 (a divisor of an 8-GPU node, and of the model's KV heads); --replicas counts "
                             "replicas, so the run holds replicas × T GPUs. Stock verl is also priced at every other "
                             "such width of those GPUs (verl-tp), a bundled model shape giving each width's KV cache")


def stock_widths(args: argparse.Namespace, perf: PerfModel, engine: EngineConfig) -> dict[int, EngineConfig]:
    """Stock verl's engine at every single width of the run's GPUs (``engine`` at its own; the others admit
    --max-num-seqs' requests per GPU, else verl's 256), {} where no bundled model shape gives a width's KV cache,
    --num-gpu-blocks fixes one replica's, or the engine speculates (not weighed there)."""
    shape = engine_shape(args.engine_defaults, perf)
    if not shape or engine.speculative is not None or args.num_gpu_blocks is not None:
        return {}
    per_gpu = args.max_num_seqs / engine.width if args.max_num_seqs is not None else 256
    return single_widths(shape, perf, engine, args.replicas * engine.width, per_gpu)


def engine_shape(choice: str | None, perf: PerfModel | None) -> str | None:
    """The model shape ``--engine-defaults`` names (None: no limit): ``auto`` reads it from a bundled
    H200 table's rows (``table:h200-dense:qwen3-1.7b``), none from any other performance model."""
    if choice == "auto":
        kind, _, rest = str(getattr(perf, "name", "")).partition(":")
        table, _, model = rest.rpartition(":")
        return model if kind == "table" and table in BUNDLED_TABLES and model in H200_MODELS else None
    return None if choice == "none" else choice


def prediction_engine(args: argparse.Namespace, calibration: Calibration, perf: PerfModel
                      ) -> tuple[EngineConfig, str | None]:
    """The engine that predicts a server measured by ``calibration`` (``bench``, ``closed-loop``), and
    a note for stderr (None: nothing to say): what its ``tailsieve calibrate`` run measured (KV blocks,
    block size, prefill rate) over the flags' engine (``--engine-defaults``, a prefill rate derived from
    the table), with every field flag and ``--spec-*`` speculation the user gave overriding the
    measurement. A calibration without engine facts: the flags alone, and the note says so. A
    speculating server's table already holds its speculation (time per generated token), so its
    speculation rows are not added again. ``perf``: the decode model built from ``calibration``."""
    flags = engine_config_from_args(args, perf)
    if calibration.engine is None:
        return flags, (f"{calibration.source}: no engine section (measured before `tailsieve calibrate` recorded KV "
                       "cache and prefill), so the prediction uses the engine flags alone; calibrate again to model "
                       "the server's engine")
    try:
        measured = measured_engine_fields(calibration.engine, name=calibration.source)
    except EngineConfigError as exc:
        raise CLIError(str(exc)) from None
    spec = measured.pop("speculative", None)
    given = {name: getattr(flags, name) for name in FIELD_FLAGS if getattr(args, name) is not None}
    note = None
    if flags.speculative is not None:
        given["speculative"] = flags.speculative
    elif spec is not None:
        note = (f"{calibration.source}: the server speculated (k = {spec.num_speculative_tokens}); its decode table is "
                "already time per generated token, so the prediction adds no speculation on top")
    try:
        return replace(flags, **{**measured, **given}), note
    except EngineConfigError as exc:
        raise CLIError(f"{calibration.source} with the engine flags: {exc}") from None


POOLS = ("tail", "bulk")


def add_pool_speculation_args(parser: argparse.ArgumentParser) -> None:
    """TailSieve's per-pool speculation flags (``simulate``), in vLLM's words per pool."""
    g = parser.add_argument_group(
        "per-pool speculation (TailSieve's tail and bulk pools; unset: the shared engine, or a policy's own)",
        "the --spec-* flags give acceptance, draft cost and decay (MTP-like assumptions where not given); "
        "they apply to tailsieve, tailsieve-fixed, best-static, tailsieve-spec (its tail k=6 / bulk schedule "
        "otherwise) and the tail pool of tailsieve-auto")
    for pool in POOLS:
        g.add_argument(f"--{pool}-num-speculative-tokens", type=IntRule(0, 64), metavar="K",
                       help=f"draft tokens per request per step on the {pool} pool's replicas (0: no speculation)")
        g.add_argument(f"--{pool}-spec-schedule", type=_schedule, metavar="B1-B2:K,...",
                       help=f"vLLM dynamic SD on the {pool} pool's replicas, e.g. 1-64:3,65-128:1,129-256:0")


def pool_engines_from_args(args: argparse.Namespace, engine: EngineConfig,
                           speculation: SpeculativeConfig) -> dict[str, EngineConfig | None]:
    """``tail_engine`` and ``bulk_engine`` of :class:`core.simulation.sim.SimConfig`: ``engine`` with the pool's
    depth or schedule and ``speculation``'s acceptance, draft cost and decay (None: no pool flag)."""
    out: dict[str, EngineConfig | None] = {}
    for pool in POOLS:
        k, schedule = getattr(args, f"{pool}_num_speculative_tokens"), getattr(args, f"{pool}_spec_schedule")
        out[f"{pool}_engine"] = None
        if k is None and schedule is None:
            continue
        deepest = max(entry[2] for entry in schedule) if schedule else None
        if schedule and (k == 0 or deepest == 0):
            raise CLIError(f"--{pool}-spec-schedule speculates nothing with --{pool}-num-speculative-tokens {k} and "
                           f"a deepest k of {deepest}: drop the schedule, or give it a k > 0")
        if k == 0:
            out[f"{pool}_engine"] = replace(engine, speculative=None)
            continue
        try:
            spec = replace(speculation, num_speculative_tokens=k if k is not None else deepest, schedule=schedule or ())
        except EngineConfigError as exc:
            raise CLIError(f"--{pool}-spec-schedule: {exc}") from None
        out[f"{pool}_engine"] = replace(engine, speculative=spec)
    return out


def _verify_table(args: argparse.Namespace) -> VerifyTable | None:
    return VerifyTable.load(args.spec_verify_table) if args.spec_verify_table else None


def _acceptance_values(value: tuple[float, ...] | MeasuredAcceptance) -> tuple[float, ...]:
    return value.values if isinstance(value, MeasuredAcceptance) else value


@dataclass(frozen=True)
class SpeculationWithSource(SpeculativeConfig):
    """The speculation policies' speculation with an acceptance someone stated (measured by ``tailsieve
    calibrate``, or given as numbers), and where it came from; a plain :class:`SpeculativeConfig` there
    is the assumption :data:`core.simulation.sim.DEFAULT_SPECULATION`."""

    acceptance_source: str = ""


def acceptance_source(speculation: SpeculativeConfig) -> str | None:
    """Where the speculation policies' acceptance came from, for the recommendation line; None: assumed,
    and then no speculation is recommended (:func:`assumed_acceptance_refusal`)."""
    return speculation.acceptance_source if isinstance(speculation, SpeculationWithSource) else None


def assumed_acceptance_refusal() -> str:
    """Why no speculation is recommended on the assumed acceptance, and how to measure one. The assumed
    figures are public MTP figures (DeepSeek-V3's report, vLLM PR #48892) not measured under sampling at
    temperature 1.0; no published per-position figure that is carries over to a policy in training
    (acceptance falls as its entropy rises: Qwen's Bebop, arXiv 2606.12370), and verl's own MTP guide
    (docs/advance/mtp.md) measured rollout throughput falling ~50 % with MTP (mimo-7B, SGLang, H20)."""
    assumed = ",".join(f"{a:g}" for a in DEFAULT_SPECULATION.acceptance)
    return (f"speculation not recommended: its acceptance is assumed ({assumed} per draft position, public MTP "
            "figures not measured at your temperature; verl's MTP guide measured rollout throughput -50 % with MTP); "
            "measure it with `tailsieve calibrate --temperature T` on a speculating vLLM server and pass "
            "--spec-acceptance CAL.json")


def speculation_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """The speculation of ``simulate``'s speculation policies: the ``--spec-*`` flags, and where one is
    not given the MTP-like assumption :data:`core.simulation.sim.DEFAULT_SPECULATION` (acceptance 0.85,0.8,0.75,
    draft cost 1/28, k = 3, no decay). A measured acceptance (``--spec-acceptance CAL.json``) brings its k
    unless ``--num-speculative-tokens`` or a schedule gives one; a stated acceptance is a
    :class:`SpeculationWithSource`."""
    base = DEFAULT_SPECULATION
    given = args.spec_acceptance
    k = args.num_speculative_tokens
    if k is None and args.spec_schedule:
        k = max(entry[2] for entry in args.spec_schedule)
    if k is None and isinstance(given, MeasuredAcceptance):
        k = given.k
    fields = dict(acceptance_half_life=(args.spec_acceptance_half_life if args.spec_acceptance_half_life is not None
                                        else base.acceptance_half_life),
                  draft_cost=args.spec_draft_cost if args.spec_draft_cost is not None else base.draft_cost,
                  verify_table=_verify_table(args))
    try:
        if given is None:
            return SpeculativeConfig(k or base.num_speculative_tokens, base.acceptance, **fields)
        source = given.source if isinstance(given, MeasuredAcceptance) else "given by --spec-acceptance"
        return SpeculationWithSource(k or base.num_speculative_tokens, _acceptance_values(given), **fields,
                                     acceptance_source=source)
    except EngineConfigError as exc:
        raise CLIError(str(exc)) from None
