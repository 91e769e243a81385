"""`tailsieve calibrate`: measure a live vLLM OpenAI server's decode step time over concurrency ×
context and write the calibration JSON that ``table:PATH`` / ``fitted:PATH`` read, with the engine's
facts (KV cache from /metrics, prefill rate, speculation's k, accepted tokens per step by batch and
acceptance per draft position at ``--temperature``) that
:func:`tailsieve_verl.core.engine.engine.engine_from_calibration` turns into the engine model and
``--spec-acceptance FILE`` reads."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Callable, Iterator

from ..core.engine.perf import TablePerf
from ..core.data.trace import MAX_TOKENS
from .checks import output_file


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers in 1..MAX_TOKENS (batch sizes, prompt lengths)."""
    try:
        values = tuple(int(x, 10) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    bad = [v for v in values if not 1 <= v <= MAX_TOKENS]
    if bad:
        raise argparse.ArgumentTypeError(f"expected integers in 1..{MAX_TOKENS:,}, got {bad[0]}")
    return values


@contextlib.contextmanager
def progress_bar(label: str, total: int, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (nothing when ``quiet``); yields ``advance(description)``."""
    if quiet:
        yield lambda description: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(f"{label} [progress.description]{{task.description}}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=False) as progress:
        task = progress.add_task("starting", total=total)
        yield lambda description: progress.update(task, advance=1, description=description)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure decode step time vs concurrency × context on a live vLLM server",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", required=True, help="vLLM OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="served model name (default: the server's only model)")
    p.add_argument("--out", default="calibration.json", help="calibration JSON file to write")
    p.add_argument("--batches", type=int_list, default=(1, 2, 4, 8, 16, 32),
                   help="concurrent requests per point (comma list)")
    p.add_argument("--prompt-lens", type=int_list, default=(16, 448),
                   help="prompt tokens per request (comma list); sets the context levels")
    p.add_argument("--decode-short", type=int, default=16, help="tokens of the short run")
    p.add_argument("--decode-long", type=int, default=64, help="tokens of the long run")
    p.add_argument("--repeats", type=int, default=3, help="short/long pairs per point (median kept)")
    p.add_argument("--prefill-lens", type=int_list, default=(16, 1024),
                   help="short,long prompt tokens of the prefill-rate measurement")
    p.add_argument("--prefill-batch", type=int, default=2,
                   help="requests per prefill sample (0: do not measure the prefill rate)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of every request (RL's: verl's rollout default 1); speculation's "
                        "acceptance per draft position is measured at it and recorded with it")
    p.add_argument("--device", help="hardware description stored in the file (default: this host's CPU)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request")
    p.add_argument("--json", action="store_true", help="print the calibration document as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..core.engine.engine import engine_from_calibration
    from ..tools.calibrate import SweepPlan, calibrate, write_calibration
    from ..tools.openai_client import OpenAIServer

    output_file(args.out, "--out")
    plan = SweepPlan(batches=tuple(args.batches), prompt_lens=tuple(args.prompt_lens),
                     decode_short=args.decode_short, decode_long=args.decode_long, repeats=args.repeats,
                     prefill_lens=tuple(args.prefill_lens), prefill_batch=args.prefill_batch)
    server = OpenAIServer(args.url, args.model, timeout_s=args.timeout, temperature=args.temperature)
    with progress_bar("calibrate", plan.repeats * len(plan.points), quiet=args.json) as advance:
        doc = calibrate(server, plan, device=args.device,
                        on_sample=lambda done, total, batch, context, step_s: advance(
                            f"batch {batch:>4} ctx {context:>6.0f}: {step_s * 1000:.2f} ms/step"))
    cal = write_calibration(doc, args.out)
    engine = engine_from_calibration(doc, base_perf=None)  # the engine section must build the engine model
    TablePerf(cal)  # the file must build the table model that `table:PATH` will build
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"model {cal.model} on {doc['device']} (server {doc['server_version']})")
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'tok/s/req':>10}")
    for row in doc["rows"]:
        print(f"{row['batch']:>6} {row['context']:>8.0f} {row['step_ms']:>9.2f} {row['per_request_tok_s']:>10.1f}")
    print(describe_engine(doc["engine"], engine))
    print(f"wrote {args.out}; use it as --perf-model table:{args.out}")
    return 0



def describe_engine(facts: dict, engine) -> str:
    """The engine facts in a few lines (what the calibration file's ``engine`` section holds)."""
    lines = []
    if engine.num_gpu_blocks is not None:
        lines.append(f"KV cache: {facts['num_gpu_blocks']} blocks x {engine.block_size} tokens (vllm:cache_config_info), "
                     f"{engine.capacity_tokens:,.0f} tokens for requests (one block is vLLM's null block)")
    else:
        lines.append(f"KV cache: unknown ({facts.get('kv_note', 'not measured')})")
    if "prefill" in facts:
        lines.append(f"prefill: {engine.prefill_s_per_token * 1e6:.2f} us/token")
    spec = facts.get("speculative") or {}
    for row in spec.get("rows", []):
        accepted = ", ".join("-" if a is None else f"{a:.2f}" for a in row["acceptance"])
        lines.append(f"speculation at batch {row['batch']:>4} ctx {row['context']:>6.0f}: k {row['k']:.2f}, "
                     f"{row['tokens_per_step']:.2f} tokens/step, {row['step_ms']:.2f} ms/step, acceptance {accepted}")
    if engine.speculative is not None:
        temperature = spec.get("temperature")
        at = "an unrecorded temperature" if temperature is None else f"temperature {temperature:g}"
        lines.append(f"acceptance per draft position at {at}: "
                     + ", ".join(f"{a:.3f}" for a in engine.speculative.acceptance)
                     + f" (k = {engine.speculative.num_speculative_tokens}, {spec.get('drafts', 0):.0f} drafts); "
                     "`tailsieve simulate`/`plan` take it as --spec-acceptance FILE")
    return "\n".join(lines)
