"""`tailsieve trace ROLLOUT_DIR -o OUT.jsonl`: convert verl rollout dumps (trainer.rollout_data_dir)
into the trace format that route, study, simulate and plan read.

Default: a prompt pool, one line per prompt (identified by its text across steps) with every
response length observed for it. With --step N: that step's groups only. Give --tokenizer (a local
HF model/tokenizer directory, e.g. the policy's) for token counts; without it lengths are
whitespace-word counts, a rough proxy."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Sequence

from ..core.data.rollout_dump import STEP_FILE, TokenCounter, build_trace, summarize
from ..core.data.trace import MAX_TOKENS, TraceError, write_trace
from ..core.data.workload import PRESETS, LengthProfile, preset_profile
from ..core.errors import needs_package
from .checks import CLIError, IntRule, is_inside, output_file


def tokenizer_counter(path: str | os.PathLike) -> TokenCounter:
    """Token counts from a local Hugging Face tokenizer directory (nothing is downloaded)."""
    path = Path(path)
    if not path.is_dir():
        raise TraceError(f"--tokenizer {path}: not a directory; give a local Hugging Face model or tokenizer "
                         "directory (the policy's, e.g. the recipe's MODEL_PATH)")
    with needs_package("transformers", f"--tokenizer {path}: counting tokens"):
        from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise TraceError(f"--tokenizer {path}: cannot load a tokenizer there ({str(e).splitlines()[0]})") from None

    def count(texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    return count


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "trace", help="convert verl rollout dumps into a trace / prompt pool",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rollout_dir", metavar="ROLLOUT_DIR", help="trainer.rollout_data_dir of a verl run, or one {step}.jsonl")
    p.add_argument("-o", "--output", required=True,
                   help="trace file to write (.jsonl, or .parquet); never the dump itself nor a path inside the dump "
                        "directory")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="local HF tokenizer directory for token counts")
    p.add_argument("--step", type=int, default=None, help="only this step, one group per prompt group")
    p.add_argument("--max-response-length", type=IntRule(1, MAX_TOKENS), metavar="TOKENS",
                   help="the run's data.max_response_length: the share of responses that hit it is printed (default: "
                        "the share at the longest response)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def profile_lines(profile: LengthProfile, cap_given: bool) -> list[str]:
    """A pool's response lengths beside the presets', and the closest preset (by P90/P50 in log space);
    without a known cap the share is counted at the longest response."""
    presets = "; ".join(f"{name} {p.tail_ratio:.1f}, {p.mean_ratio:.2f}, {100 * p.cap_share:.1f} %"
                        for name, p in ((name, preset_profile(name)) for name in PRESETS))
    cap = f"at the cap {profile.cap}" if cap_given else f"at the longest response, {profile.cap}"
    return [f"response lengths: P90/P50 {profile.tail_ratio:.2f} (P50 {profile.p50:.0f}, P90 {profile.p90:.0f}), "
            f"mean {profile.mean:.0f} ({profile.mean_ratio:.2f} × P50), {100 * profile.cap_share:.1f} % {cap}",
            f"presets (P90/P50, mean/P50, share at the 16384 cap): {presets}; closest: {profile.closest_preset()} "
            "(by P90/P50)"]


def profile_json(profile: LengthProfile) -> dict:
    return profile.to_json() | {"closest_preset": profile.closest_preset(),
                                "presets": {name: preset_profile(name).to_json() for name in PRESETS}}


def check_output(rollout_dir: str | os.PathLike, output: str | os.PathLike) -> Path:
    """``-o`` must be a new file outside the dump: writing into the dump directory would overwrite a
    step file or add one that later `trace`/`route` calls read as a step."""
    out = output_file(output, "-o", inputs=[("rollout dump", rollout_dir)])
    source = Path(rollout_dir)
    if source.is_dir() and is_inside(out, source):
        poisons = True
    else:  # one {step}.jsonl: its directory is a dump too, and another {step}.jsonl there would join it
        poisons = bool(STEP_FILE.match(source.name) and STEP_FILE.match(out.name) and is_inside(out, source.parent))
    if poisons:
        raise CLIError(f"-o {out} is inside the rollout-dump directory {source if source.is_dir() else source.parent} "
                       "that this command reads; write the trace outside it (e.g. next to it)")
    return out


def run(args: argparse.Namespace) -> int:
    out = check_output(args.rollout_dir, args.output)
    count = tokenizer_counter(args.tokenizer) if args.tokenizer is not None else None
    build = build_trace(args.rollout_dir, count=count, step=args.step)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(build.trace, out)
    profile = LengthProfile.of(build.trace.lengths, args.max_response_length)
    summary = summarize(build) | {"output": args.output, "kind": "step trace" if args.step is not None else "prompt pool",
                                  "lengths": profile_json(profile)}
    if args.json:
        print(json.dumps(summary))
        return 0
    unit = "tokens" if build.exact else "whitespace words (approximate; pass --tokenizer for token counts)"
    print(f"wrote {summary['kind']} {args.output}: {summary['prompts']} prompts, {summary['responses']} responses "
          f"from {summary['steps']} step(s) {summary['first_step']}..{summary['last_step']}")
    print(f"samples per prompt {summary['samples_per_prompt_min']}..{summary['samples_per_prompt_max']}; "
          f"response length mean {summary['length_mean']:.1f}, p50 {summary['length_p50']:.0f}, "
          f"p90 {summary['length_p90']:.0f}, max {summary['length_max']} ({unit})")
    for line in profile_lines(profile, cap_given=args.max_response_length is not None):
        print(line)
    if args.step is None and summary["samples_per_prompt_max"] > build.rollout_n:
        print(f"the run sampled n = {build.rollout_n} per prompt and step; a pool line holds every step's samples, "
              f"so pass --n {build.rollout_n} to `tailsieve plan`")
    return 0
