#!/usr/bin/env python3
"""A tensor-parallel decode step on t GPUs, measured beside the engine model's first-order price of it (issue 58).

Torch only; copy this one file to a box with several NVLink GPUs and run it:

    python verify_tp_cost.py --out h200_tp_cost.json                 # widths 1, 2, 4, 8 as the GPUs allow

With fewer than 2 CUDA GPUs it says so in one line and exits with status 2, measuring nothing. ``--tiny`` runs
a tiny shape eagerly on CPU over gloo (a test of the script, not a measurement).

Method: the bundled tables' dense Qwen3 decoder (``verify_cost.py``: random bf16 weights, RMSNorm, QKV, SDPA
over a KV cache of ``context`` tokens per request, SwiGLU MLP, LM head, greedy argmax), split Megatron-style
over t processes, one GPU each, as vLLM splits it: each rank holds heads/t query heads and kv_heads/t KV heads,
intermediate/t MLP columns and vocab/t LM-head rows; an all-reduce (NCCL) after the attention output and after
the MLP of every layer, and one all-gather of the per-rank best token. The step is captured as a CUDA graph and
timed as the median of 30 replays (rank 0's clock; the collectives keep ranks in step). Alone, the all-reduce of
each step's message (``batch × hidden`` bf16) is timed the same way.

Beside each measurement, what the engine model (``tailsieve_verl.core.engine.perf.TensorParallel``) predicts
from the measured width-1 step: ``F + (T₁ − F)/t + 2·layers·(latency + 2(t−1)/t · bytes / link)``, with
``F`` = T₁(batch 1, shortest context) − weights / 4.8 TB/s, once with its cited constants (8 µs, 450 GB/s) and
once with the latency and bandwidth the all-reduce timing gives (its smallest message's time; the largest
message's bus bandwidth). :func:`model_ms` restates that formula so this file runs with torch alone;
``tests/core/test_tp_model.py`` holds the two equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import queue
import socket
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e (NVIDIA datasheet): the engine model's floor subtracts the weight read at it
ALLREDUCE_LATENCY_S = 8e-6  # the engine model's cited constants (core/engine/perf.py)
NVLINK_BYTES_PER_S = 450e9
EPS = 1e-6
REPLAYS = 30


@dataclass(frozen=True)
class Shape:
    """A dense Qwen3 decoder's sizes (``verify_cost.py``'s)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    vocab: int = 151936

    def weight_bytes(self, bytes_per_element: int = 2) -> int:
        per_layer = self.hidden * ((self.heads + 2 * self.kv_heads) * self.head_dim) + \
            self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate
        return bytes_per_element * (self.layers * per_layer + self.vocab * self.hidden)


SHAPES = {
    "qwen3-1.7b": Shape("qwen3-1.7b", 2048, 6144, 28, 16, 8),
    "qwen3-8b": Shape("qwen3-8b", 4096, 12288, 36, 32, 8),
}
TINY = Shape("tiny-dense", 64, 128, 2, 8, 8, head_dim=16, vocab=256)


def model_ms(one_gpu_ms: float, floor_ms: float, width: int, layers: int, hidden: int, batch: int,
             latency_s: float = ALLREDUCE_LATENCY_S, link_bytes_per_s: float = NVLINK_BYTES_PER_S) -> float:
    """The engine model's step at ``width`` from the width-1 step (``TensorParallel.step_time`` restated)."""
    if width == 1:
        return one_gpu_ms
    floor = min(floor_ms, one_gpu_ms)
    allreduce_s = 2 * layers * (latency_s + 2 * (width - 1) / width * batch * hidden * 2 / link_bytes_per_s)
    return floor + (one_gpu_ms - floor) / width + 1000 * allreduce_s


class ShardedDecoder:
    """One rank's shard of the decoder: 1/t of every layer's heads and MLP columns and of the LM head."""

    def __init__(self, s: Shape, width: int, device, dtype):
        def w(*size):
            return torch.randn(*size, device=device, dtype=dtype) * (1.0 / math.sqrt(size[0]))

        self.s, self.width = s, width
        self.heads, self.kv_heads, self.inter = s.heads // width, s.kv_heads // width, s.intermediate // width
        self.embed = torch.randn(s.vocab, s.hidden, device=device, dtype=dtype)
        self.lm_head = w(s.hidden, s.vocab // width)
        self.layers = [dict(qkv=w(s.hidden, (self.heads + 2 * self.kv_heads) * s.head_dim),
                            o=w(self.heads * s.head_dim, s.hidden), up=w(s.hidden, 2 * self.inter),
                            down=w(self.inter, s.hidden)) for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)

    def step(self, tokens, cache_k, cache_v):
        """One decode step: every request's next token. One KV cache serves every layer (its bytes are read per
        layer all the same; a cache per layer would not fit at the largest points)."""
        s, b = self.s, tokens.shape[0]
        x = self.embed[tokens]
        for layer in self.layers:
            h = F.rms_norm(x, (s.hidden,), self.norm, EPS)
            q, k, v = (h @ layer["qkv"]).view(b, self.heads + 2 * self.kv_heads, 1, s.head_dim).split(
                (self.heads, self.kv_heads, self.kv_heads), dim=1)
            keys, values = torch.cat([cache_k, k], dim=2), torch.cat([cache_v, v], dim=2)
            a = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            out = a.reshape(b, self.heads * s.head_dim) @ layer["o"]
            if self.width > 1:
                dist.all_reduce(out)
            x = x + out
            gate, up = (F.rms_norm(x, (s.hidden,), self.norm, EPS) @ layer["up"]).chunk(2, dim=-1)
            out = (F.silu(gate) * up) @ layer["down"]
            if self.width > 1:
                dist.all_reduce(out)
            x = x + out
        best = (F.rms_norm(x, (s.hidden,), self.norm, EPS) @ self.lm_head).max(-1).values
        if self.width > 1:
            gathered = [torch.empty_like(best) for _ in range(self.width)]
            dist.all_gather(gathered, best)
            best = torch.stack(gathered).argmax(0)
        return best


def timed_ms(fn, device) -> float:
    """Median ms of ``fn`` over the replays (CUDA events on a GPU, wall clock on CPU)."""
    fn()
    if device.type != "cuda":
        import time
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn, device):
    """``fn`` as a CUDA-graph replay on a GPU (the collectives captured too), itself on CPU."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def worker(rank: int, width: int, args: dict, port: int, out) -> None:
    """One rank of a width-``width`` replica: every (batch, context) point's step, and the all-reduce alone."""
    cuda = not args["tiny"]
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    if width > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                world_size=width, rank=rank)
    s = TINY if args["tiny"] else SHAPES[args["model"]]
    torch.manual_seed(rank)
    decoder = ShardedDecoder(s, width, device, dtype)
    rows, skipped = [], []
    for context in args["contexts"]:
        for batch in args["batches"]:
            kv = 2 * batch * (s.kv_heads // width) * context * s.head_dim * (2 if cuda else 4)
            if cuda and kv > 0.8 * torch.cuda.mem_get_info(device)[0]:
                skipped.append({"batch": batch, "context": context})
                continue
            cache = [torch.randn(batch, s.kv_heads // width, context, s.head_dim, device=device, dtype=dtype)
                     for _ in range(2)]
            tokens = torch.randint(0, s.vocab, (batch,), device=device)
            rows.append({"width": width, "batch": batch, "context": context,
                         "step_ms": timed_ms(graphed(lambda: decoder.step(tokens, *cache), device), device)})
            del cache
    allreduce = []
    if width > 1:
        for batch in args["batches"]:
            message = torch.randn(batch, s.hidden, device=device, dtype=dtype)
            allreduce.append({"width": width, "batch": batch, "bytes": message.numel() * message.element_size(),
                              "us": 1000 * timed_ms(graphed(lambda: dist.all_reduce(message), device), device)})
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        out.put({"rows": rows, "allreduce": allreduce, "skipped": skipped})


def measure(width: int, args: dict) -> dict:
    """Run ``width`` ranks and return rank 0's measurements."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(rank, width, args, port, out)) for rank in range(width)]
    for p in procs:
        p.start()
    while True:  # rank 0's result, or the failure of any rank (which would leave the others waiting)
        try:
            result = out.get(timeout=1.0)
            break
        except queue.Empty:
            if any(p.exitcode for p in procs) or all(p.exitcode is not None for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank of width {width} failed (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join()
    return result


def compare(shape: Shape, measured: dict[int, dict]) -> list[dict]:
    """Every wide measurement beside the model's price of it, from the measured width-1 step."""
    one = {(r["batch"], r["context"]): r["step_ms"] for r in measured[1]["rows"]}
    shortest = min(c for _, c in one)
    floor_ms = max(one[(1, shortest)] - 1000 * shape.weight_bytes() / HBM_BYTES_PER_S, 0.0) if (1, shortest) in one \
        else 0.0
    out = []
    for width, result in measured.items():
        ar = sorted(result["allreduce"], key=lambda r: r["bytes"])
        latency = ar[0]["us"] * 1e-6 if ar else ALLREDUCE_LATENCY_S
        bandwidth = (2 * (width - 1) / width * ar[-1]["bytes"] / max(ar[-1]["us"] * 1e-6 - latency, 1e-9)
                     if len(ar) > 1 else NVLINK_BYTES_PER_S)
        for r in result["rows"]:
            if (r["batch"], r["context"]) not in one:
                continue
            base = one[(r["batch"], r["context"])]
            out.append({**r, "model_ms": model_ms(base, floor_ms, width, shape.layers, shape.hidden, r["batch"]),
                        "model_measured_link_ms": model_ms(base, floor_ms, width, shape.layers, shape.hidden,
                                                           r["batch"], latency, bandwidth),
                        "floor_ms": floor_ms, "allreduce_latency_us": 1e6 * latency,
                        "link_gb_s": bandwidth / 1e9})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--widths", default="1,2,4,8", help="comma-separated; those the GPUs and KV heads allow run")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--out", default="tp_cost.json")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape on CPU over gloo, 2 ranks: tests the script")
    args = ap.parse_args(argv)
    gpus = 2 if args.tiny else torch.cuda.device_count()
    if gpus < 2:
        print(f"verify_tp_cost.py: a tensor-parallel step needs at least 2 CUDA GPUs, found {gpus}; nothing measured",
              file=sys.stderr)
        return 2
    shape = TINY if args.tiny else SHAPES[args.model]
    widths = [t for t in (int(x) for x in args.widths.split(",")) if t <= gpus and shape.kv_heads % t == 0
              and shape.heads % t == 0]
    if 1 not in widths:
        widths = [1] + widths  # the model prices every width from the width-1 step
    config = {"model": shape.name, "batches": [int(x) for x in args.batches.split(",")],
              "contexts": [int(x) for x in args.contexts.split(",")], "tiny": args.tiny}
    measured = {t: measure(t, config) for t in widths}
    rows = compare(shape, measured)
    doc = {"device": "cpu (tiny, gloo)" if args.tiny else torch.cuda.get_device_name(0), "gpus": gpus,
           "torch": torch.__version__, "date": datetime.date.today().isoformat(), "shape": asdict(shape),
           "rows": rows, "allreduce": [a for t in widths for a in measured[t]["allreduce"]],
           "skipped": {t: measured[t]["skipped"] for t in widths}}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'width':>5} {'batch':>5} {'context':>7} {'measured ms':>11} {'model ms':>9} {'model, measured link':>20}")
    for r in rows:
        print(f"{r['width']:>5} {r['batch']:>5} {r['context']:>7} {r['step_ms']:>11.3f} {r['model_ms']:>9.3f} "
              f"{r['model_measured_link_ms']:>20.3f}")
    for a in doc["allreduce"]:
        print(f"all-reduce, width {a['width']}, {a['bytes']} B: {a['us']:.1f} us")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
