"""Framework-free TailSieve core: traces, performance models, replica evaluator, routing
policies, oracle, selector, controller and simulator. Imports neither verl nor torch."""

from .engine.engine import EngineConfig, SpeculativeConfig
from .errors import TailSieveError
from .engine.perf import LinearPerf, PerfModel, PerfModelError, TablePerf, parse_perf_model
from .engine.replica import Evaluation, evaluate_assignment, evaluate_samples, simulate_replica, tokens_generated_at
from .data.trace import Group, Trace, TraceError, read_trace, write_trace

__all__ = [
    "EngineConfig", "SpeculativeConfig", "evaluate_samples", "tokens_generated_at",
    "Evaluation", "Group", "TailSieveError", "LinearPerf", "PerfModel", "PerfModelError", "TablePerf", "Trace", "TraceError",
    "evaluate_assignment", "parse_perf_model", "read_trace", "simulate_replica", "write_trace",
]
