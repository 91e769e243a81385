"""Turn verl's rollout dumps into TailSieve traces and prompt pools.

verl 0.9.1 (V1 trainer) writes, when ``trainer.rollout_data_dir`` is set, one ``{step}.jsonl`` per
training step with one line per consumed response: ``input`` and ``output`` (prompt and response
decoded with ``skip_special_tokens=True``), ``gts``, ``score``, ``step`` and ``uid``, the
TransferQueue key ``{sample}_{rollout}_{output}``. The ``{sample}`` part is a fresh ``uuid4`` per
step (``trainer_base._add_batch_to_generate``), so it groups the n responses of a prompt *within*
a step but cannot follow a prompt *across* steps; the decoded prompt text can, and is the prompt
identity here (``p-`` + the first 16 hex digits of its SHA-1).

Token counts: a dump line with ``response_length`` / ``prompt_length`` is used as is. Otherwise the
text is measured with a token counter (`tailsieve trace --tokenizer`: a local Hugging Face tokenizer): the encoding of the decoded
text, which equals the generated token count except for special tokens the decode dropped (the
EOS) and rare non-canonical tokenizations. Without a tokenizer, whitespace-separated words are
counted: a rough proxy, flagged in the trace name and the summary.

Two outputs, both the JSONL trace format that ``route``, ``study``, ``simulate`` and ``plan`` read:

* a **prompt pool** (default): one line per prompt identity with every length observed for it
  across all steps (a prompt drawn in several epochs contributes all its samples);
* a **step trace** (``step=N``): that step's groups, one per prompt group.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from .groups import MAX_TOKENS, Group, Trace, TraceError
from .records import iter_records

STEP_FILE = re.compile(r"^(\d+)\.jsonl$")  # verl names a step's dump {step}.jsonl
TokenCounter = Callable[[Sequence[str]], list[int]]


@dataclass(frozen=True)
class RolloutRecord:
    """One consumed response of a verl rollout dump."""

    step: int
    group: str  # the step-local group key (uid's sample part, or the prompt text)
    prompt: str
    response: str
    response_length: int | None  # token count when the dump carries it
    prompt_length: int | None


def group_key_from_uid(uid: object) -> str:
    """verl V1 keys a response ``{sample}_{rollout}_{output}``; its group is ``{sample}``."""
    parts = str(uid).rsplit("_", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else str(uid)


def prompt_identity(prompt: str) -> str:
    return "p-" + hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def dump_files(path: str | os.PathLike, step: int | None = None) -> list[tuple[int, Path]]:
    """``(step, file)`` of a rollout-dump directory (verl's ``{step}.jsonl`` names), or of one file."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    if path.is_file():
        match = STEP_FILE.match(path.name)
        return [(int(match.group(1)) if match else -1, path)]
    if not path.is_dir():
        raise TraceError(f"{path}: not a regular file or directory; give a verl rollout dump directory or one "
                         "{step}.jsonl")
    files = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := STEP_FILE.match(p.name)))
    if step is not None:
        files = [(s, p) for s, p in files if s == step]
    if not files:
        what = f"{step}.jsonl" if step is not None else "{step}.jsonl files"
        raise TraceError(f"{path}: no verl rollout dump ({what}) found; point at the trainer.rollout_data_dir "
                         "of a verl run")
    return files


def _optional_int(record: dict, key: str, where: str) -> int | None:
    value = record.get(key)
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            or int(value) != value):
        raise TraceError(f"{where}: {key} = {value!r} is not a non-negative integer token count")
    if value > MAX_TOKENS:
        raise TraceError(f"{where}: {key} = {value:.0f} is above the {MAX_TOKENS:,}-token limit on a length")
    return int(value)


def read_rollout_records(path: str | os.PathLike, step: int | None = None) -> Iterator[RolloutRecord]:
    for file_step, file in dump_files(path, step):
        for where, rec in iter_records(file):
            if not isinstance(rec, dict) or not isinstance(rec.get("input"), str) or (
                    not isinstance(rec.get("output"), str) and "response_length" not in rec):
                raise TraceError(f"{where}: not a verl rollout dump line (needs the decoded 'input' and "
                                 "'output' texts); for a trace file use `tailsieve route --trace` directly")
            rec_step = rec.get("step", file_step)
            if isinstance(rec_step, bool) or not isinstance(rec_step, int):
                raise TraceError(f"{where}: step = {rec_step!r} is not an integer")
            group = group_key_from_uid(rec["uid"]) if rec.get("uid") else rec["input"]
            yield RolloutRecord(rec_step, str(group), rec["input"], rec.get("output") or "",
                                _optional_int(rec, "response_length", where),
                                _optional_int(rec, "prompt_length", where))


def whitespace_counter(texts: Sequence[str]) -> list[int]:
    return [len(t.split()) for t in texts]


@dataclass(frozen=True)
class TraceBuild:
    trace: Trace
    steps: tuple[int, ...]
    responses: int
    exact: bool  # every length is a token count (dump field or tokenizer)
    rollout_n: int  # responses per prompt group within a step (median): the run's rollout.n


def _lengths(records: list[RolloutRecord], count: TokenCounter) -> tuple[list[int], list[int]]:
    missing = [i for i, r in enumerate(records) if r.response_length is None]
    measured = count([records[i].response for i in missing])
    response = [r.response_length for r in records]
    for i, n in zip(missing, measured):
        response[i] = n
    prompts = OrderedDict((r.prompt, None) for r in records if r.prompt_length is None)
    prompt_counts = dict(zip(prompts, count(list(prompts))))
    prompt = [r.prompt_length if r.prompt_length is not None else prompt_counts[r.prompt] for r in records]
    return response, prompt


def build_trace(path: str | os.PathLike, count: TokenCounter | None = None,
                step: int | None = None) -> TraceBuild:
    """A prompt pool over every step of the dump, or the groups of one ``step``.

    ``count`` measures texts in tokens (e.g. a tokenizer); without it, whitespace words."""
    records = list(read_rollout_records(path, step))
    if not records:
        raise TraceError(f"{path}: the rollout dump has no responses")
    exact_from_dump = all(r.response_length is not None and r.prompt_length is not None for r in records)
    response, prompt = _lengths(records, count or whitespace_counter)
    exact = exact_from_dump or count is not None

    groups: "OrderedDict[str, dict]" = OrderedDict()
    for rec, length, prompt_len in zip(records, response, prompt):
        identity = prompt_identity(rec.prompt)
        key = identity if step is None else f"{identity}\0{rec.group}"
        entry = groups.setdefault(key, {"identity": identity, "lengths": [], "prompt_len": prompt_len})
        entry["lengths"].append(length)
    out, used = [], {}
    for entry in groups.values():
        # a prompt drawn twice in one step (duplicate dataset rows) forms two groups: suffix the id
        used[entry["identity"]] = used.get(entry["identity"], 0) + 1
        pid = entry["identity"] if used[entry["identity"]] == 1 else f"{entry['identity']}#{used[entry['identity']]}"
        out.append(Group(pid, tuple(entry["lengths"]), entry["prompt_len"]))
    name = str(path) + ("" if exact else " (lengths approximated by whitespace words)")
    steps = tuple(sorted({r.step for r in records}))
    per_group = Counter((r.step, r.group) for r in records)
    rollout_n = int(np.median(list(per_group.values())))
    return TraceBuild(Trace(tuple(out), name=name), steps, len(records), exact, rollout_n)


def summarize(build: TraceBuild) -> dict:
    lengths = np.array(build.trace.lengths)
    samples = np.array([g.n for g in build.trace])
    return {
        "steps": len(build.steps),
        "first_step": build.steps[0],
        "last_step": build.steps[-1],
        "responses": build.responses,
        "rollout_n": build.rollout_n,
        "prompts": len(build.trace),
        "samples_per_prompt_min": int(samples.min()),
        "samples_per_prompt_max": int(samples.max()),
        "length_mean": float(lengths.mean()),
        "length_p50": float(np.percentile(lengths, 50)),
        "length_p90": float(np.percentile(lengths, 90)),
        "length_max": int(lengths.max()),
        "exact_token_counts": build.exact,
    }
