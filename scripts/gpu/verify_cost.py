#!/usr/bin/env python3
"""Speculative verify cost on one GPU: a plain decode step, a verify step of k + 1 query tokens per
request, and a one-layer MTP-style draft step, versus batch and context (issue 21).

Torch only; copy this one file to a GPU box and run it:

    python verify_cost.py --out h200_verify_cost.json            # ~8 minutes on an H200
    tailsieve verify-cost h200_verify_cost.json:qwen3-1.7b        # measured next to the first-order model

Method (the bundled ``h200_*_decode_curve.json`` tables' method, so decode rows are comparable): a
Qwen3-shaped decoder with random bf16 weights (embedding; per layer RMSNorm, QKV, SDPA over a KV
cache of ``context`` tokens per request, output projection, RMSNorm, SwiGLU MLP — for the MoE shape a
softmax top-8-of-128 router and experts as two ``torch._grouped_mm`` calls; final RMSNorm, LM head,
greedy argmax). RoPE and Qwen3's q/k norms are left out, as in the bundled tables. Each step is
captured as one CUDA graph per shape and timed as the median of 30 replays; each row keeps the
faster of the attention backends tried (5 replays each pick it; field ``attention``).

* ``decode``: one new token per request, attending its ``context`` cached tokens and itself.
* ``verify``: k + 1 new tokens per request (the last accepted token and k drafts), each attending the
  whole cache and the new tokens up to itself (causal within the new tokens); logits for every
  position, greedy acceptance of the drafts.
* ``draft``: one MTP-style draft token per request: RMSNorm'd embedding of the last token and the
  target's hidden state, concatenated and projected (2h -> h), one decoder layer of the model's own
  kind over its own KV cache of ``context`` tokens, the shared LM head, argmax. A depth-k draft runs
  it k times, so ``draft / decode`` is the engine model's ``draft_cost`` per draft token.

Decode is also measured at context 0 (only the new token's KV) up to batch ``max(batches)·(k_max+1)``:
the first-order model prices a verify step as ``T(b·(k+1), 0) + T(b, c) − T(b, 0)``.

A grid point whose KV cache does not fit in free GPU memory is skipped (listed under ``skipped``).
``--budget-s`` bounds the run: every model gets an equal share of what is left, a measurement is not
started past its model's share, and the JSON (rewritten after every grid point) holds what was done;
``stopped_early`` says whether the budget cut the grid. ``--tiny`` runs tiny shapes eagerly on CPU
(a test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # lower-right causal masks dispatch to the flash kernel without materialising a mask
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover - torch < 2.3
    sys.exit("verify_cost.py needs torch >= 2.5 (torch.nn.attention.bias.causal_lower_right)")


@dataclass(frozen=True)
class Shape:
    """A Qwen3 decoder's sizes (MoE when ``experts`` > 0)."""

    name: str
    hidden: int
    intermediate: int  # dense MLP width, or one expert's width for MoE
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    vocab: int = 151936
    experts: int = 0  # 0: dense
    top_k: int = 0


SHAPES = {
    "qwen3-1.7b": Shape("qwen3-1.7b", 2048, 6144, 28, 16, 8),
    "qwen3-8b": Shape("qwen3-8b", 4096, 12288, 36, 32, 8),
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 2048, 768, 48, 32, 4, experts=128, top_k=8),
}
TINY_SHAPES = {
    "tiny-dense": Shape("tiny-dense", 64, 128, 2, 4, 2, head_dim=16, vocab=256),
    "tiny-moe": Shape("tiny-moe", 64, 32, 2, 4, 2, head_dim=16, vocab=256, experts=8, top_k=2),
}
DEFAULT_BATCHES = (1, 4, 16, 64, 256)
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
DEFAULT_KS = (1, 2, 3, 4, 5, 6)
EPS = 1e-6
PROBE_RUNS = 5  # runs that pick the faster attention backend before the timed replays


class Layer:
    """One decoder layer's weights (random, scaled so activations stay finite)."""

    def __init__(self, s: Shape, device, dtype):
        def w(*size):
            return torch.randn(*size, device=device, dtype=dtype) * (1.0 / math.sqrt(size[-2]))

        self.s = s
        self.norm1 = torch.ones(s.hidden, device=device, dtype=dtype)
        self.norm2 = torch.ones(s.hidden, device=device, dtype=dtype)
        self.qkv = w(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim)
        self.o = w(s.heads * s.head_dim, s.hidden)
        if s.experts:
            self.router = w(s.hidden, s.experts)
            self.up = w(s.experts, s.hidden, 2 * s.intermediate)  # gate and up, fused
            self.down = w(s.experts, s.intermediate, s.hidden)
        else:
            self.up = w(s.hidden, 2 * s.intermediate)
            self.down = w(s.intermediate, s.hidden)

    def mlp(self, x):
        s = self.s
        if not s.experts:
            gate, up = (x @ self.up).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ self.down
        tokens = x.shape[0]
        weights, experts = torch.topk(torch.softmax((x @ self.router).float(), dim=-1), s.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # fixed size: capturable
        counts = torch.zeros(s.experts, device=x.device, dtype=torch.int32)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        source = order // s.top_k  # token of each sorted (token, expert) pair
        gate, up = torch._grouped_mm(x[source], self.up, offs=offs).chunk(2, dim=-1)
        out = torch._grouped_mm((F.silu(gate) * up).contiguous(), self.down, offs=offs)
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros(tokens, s.hidden, device=x.device, dtype=x.dtype).index_add_(0, source, out)

    def forward(self, x, cache_k, cache_v, context: int, query: int, attention: str):
        """x: (batch·query, hidden). Writes the new K/V at [context, context + query) and attends
        [0, context + query), causal within the new tokens."""
        s = self.s
        b = x.shape[0] // query
        h = F.rms_norm(x, (s.hidden,), self.norm1, EPS)
        qkv = (h @ self.qkv).view(b, query, s.heads + 2 * s.kv_heads, s.head_dim).transpose(1, 2)
        q, k, v = qkv.split((s.heads, s.kv_heads, s.kv_heads), dim=1)
        end = context + query
        cache_k[:, :, context:end] = k
        cache_v[:, :, context:end] = v
        a = attend(q, cache_k[:, :, :end], cache_v[:, :, :end], attention)
        x = x + a.transpose(1, 2).reshape(b * query, s.heads * s.head_dim) @ self.o
        return x + self.mlp(F.rms_norm(x, (s.hidden,), self.norm2, EPS))


def attend(q, k, v, attention: str):
    """SDPA with GQA; for several query tokens a lower-right causal mask (query i sees the cache
    and new tokens 0..i). ``attention`` names the backend forced (``default``: torch's choice)."""
    mask = causal_lower_right(q.shape[2], k.shape[2]) if q.shape[2] > 1 else None
    if attention == "default":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[attention]
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def reference_attend(q, k, v):
    """Query token i of n new tokens attends keys [0, S − n + i]: one token at a time, no mask."""
    n, total = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    outs = [F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :total - n + i + 1], v[:, :, :total - n + i + 1])
            for i in range(n)]
    return torch.cat(outs, dim=2)


class Model:
    """Embedding, decoder layers, final norm, LM head (tied to the embedding), and an MTP head."""

    def __init__(self, s: Shape, device, dtype):
        self.s, self.device, self.dtype = s, device, dtype
        self.embed = torch.randn(s.vocab, s.hidden, device=device, dtype=dtype)
        self.layers = [Layer(s, device, dtype) for _ in range(s.layers)]
        self.final_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.mtp_layer = Layer(s, device, dtype)
        self.mtp_proj = torch.randn(2 * s.hidden, s.hidden, device=device, dtype=dtype) / math.sqrt(2 * s.hidden)

    def kv_bytes(self, batch: int, slots: int, layers: int) -> int:
        return 2 * layers * batch * self.s.kv_heads * slots * self.s.head_dim * torch.finfo(self.dtype).bits // 8

    def new_cache(self, batch: int, slots: int, layers: int):
        shape = (batch, self.s.kv_heads, slots, self.s.head_dim)
        return [(torch.randn(shape, device=self.device, dtype=self.dtype),
                 torch.randn(shape, device=self.device, dtype=self.dtype)) for _ in range(layers)]

    def logits_argmax(self, x):
        return (F.rms_norm(x, (self.s.hidden,), self.final_norm, EPS) @ self.embed.t()).argmax(-1)

    def target_step(self, tokens, cache, context: int, attention: str):
        """Decode (tokens: batch × 1) or verify (batch × (k+1)): every position's greedy token, and
        how many drafts (tokens[:, 1:]) the target accepts."""
        b, query = tokens.shape
        x = self.embed[tokens.reshape(-1)]
        for layer, (ck, cv) in zip(self.layers, cache):
            x = layer.forward(x, ck, cv, context, query, attention)
        predicted = self.logits_argmax(x).view(b, query)
        accepted = (predicted[:, :-1] == tokens[:, 1:]).int().cumprod(-1).sum(-1)
        return predicted, accepted

    def draft_step(self, tokens, hidden, cache, context: int, attention: str):
        """One MTP draft token per request from the last token and the target's hidden state."""
        s = self.s
        e = F.rms_norm(self.embed[tokens.reshape(-1)], (s.hidden,), self.final_norm, EPS)
        h = F.rms_norm(hidden, (s.hidden,), self.final_norm, EPS)
        x = torch.cat([e, h], dim=-1) @ self.mtp_proj
        ck, cv = cache[0]
        return self.logits_argmax(self.mtp_layer.forward(x, ck, cv, context, 1, attention))


def prepare(fn, device, graphs: bool):
    """A callable that runs ``fn``'s step: a replay of one CUDA graph captured after two warm-up
    runs on CUDA, ``fn`` itself elsewhere (tests)."""
    if device.type != "cuda" or not graphs:
        fn()
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    return graph.replay


def timed_runs(step, device, n: int) -> list[float]:
    """Milliseconds of each of ``n`` runs (CUDA events on CUDA, wall clock elsewhere)."""
    if device.type != "cuda":
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1000)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def best_of(fn_for_backend, backends, device, replays, graphs):
    """(times, backend): every backend that runs this step (one that cannot, for want of a kernel
    for these shapes, is skipped; torch's own choice is tried when none ran) is timed over
    ``PROBE_RUNS`` runs, and the fastest over ``replays`` more."""
    ready, errors = [], []
    for backend in backends:
        try:
            ready.append((prepare(lambda backend=backend: fn_for_backend(backend), device, graphs), backend))
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as e:  # no kernel for this backend and shape
            errors.append(f"{backend}: {str(e).splitlines()[0][:120]}")
            if device.type == "cuda":
                torch.cuda.synchronize()
    if not ready and "default" not in backends:
        return best_of(fn_for_backend, ("default",), device, replays, graphs)
    if not ready:
        raise RuntimeError("no attention backend ran this step: " + "; ".join(errors))
    if len(ready) > 1:
        ready.sort(key=lambda entry: statistics.median(timed_runs(entry[0], device, PROBE_RUNS)))
    step, backend = ready[0]
    return timed_runs(step, device, replays), backend


def row(model: str, kind: str, batch: int, context: int, k: int, times: list[float], backend: str) -> dict:
    step = statistics.median(times)
    r = {"model": model, "kind": kind, "batch": batch, "context": context, "k": k,
         "query_tokens": batch * (k + 1) if kind == "verify" else batch, "step_ms": step,
         "step_ms_min": min(times), "step_ms_max": max(times), "attention": backend}
    if kind == "decode":
        r["per_req_tok_s"] = 1000.0 / step
        r["agg_tok_s"] = batch * 1000.0 / step
    return r


def check_attention(device, dtype, verify_backends, decode_backends) -> None:
    """Every backend's attention equals the token-at-a-time reference (catches a wrong mask)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    for n, backends in ((3, verify_backends), (1, decode_backends)):
        q = torch.randn(2, 4, n, 128, generator=g).to(device, dtype)
        k = torch.randn(2, 2, 11, 128, generator=g).to(device, dtype)
        v = torch.randn(2, 2, 11, 128, generator=g).to(device, dtype)
        want = reference_attend(q.float(), k.float(), v.float())
        for backend in backends:
            try:
                got = attend(q, k, v, backend).float()
            except RuntimeError:
                continue  # not available here; best_of skips it too
            err = (got - want).abs().max().item()
            if err > 5e-2:
                raise SystemExit(f"attention with backend {backend} ({n} query tokens) differs from the "
                                 f"token-at-a-time reference by {err:.3g}")


class Run:
    """The grid of one run and the JSON it writes."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device("cpu" if args.tiny else args.device)
        self.dtype = torch.float32 if args.tiny else torch.bfloat16
        self.graphs = self.device.type == "cuda"
        cuda = self.device.type == "cuda"
        self.decode_backends = ("cudnn", "flash") if cuda else ("default",)
        self.verify_backends = ("flash", "cudnn") if cuda else ("default",)
        self.start = time.monotonic()
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.stopped_early = False
        props = torch.cuda.get_device_properties(self.device) if cuda else None
        self.header = {
            "device": props.name if props else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "method": ("random-weight Qwen3-shaped decoder, one CUDA graph per shape, median of "
                       f"{args.replays} replays" if self.graphs else
                       f"eager on {self.device.type}, median of {args.replays} calls (a test, not a measurement)"),
            "kinds": "decode: 1 query token per request; verify: k+1 (causal within them); draft: one MTP layer",
            "budget_s": args.budget_s,
            "shapes": {name: vars(s) for name, s in (TINY_SHAPES if args.tiny else SHAPES).items()},
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def write(self) -> None:
        data = dict(self.header, stopped_early=self.stopped_early, skipped=self.skipped, rows=self.rows)
        with open(self.args.out, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")

    def fits(self, model: Model, batch: int, slots: int, layers: int) -> bool:
        if self.device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        logits = batch * (max(self.args.ks) + 1) * model.s.vocab * 4
        return model.kv_bytes(batch, slots, layers) + 2 * logits < self.args.memory_fraction * free

    def measure(self, fn_for_backend, backends):
        return best_of(fn_for_backend, backends, self.device, self.args.replays, self.graphs)

    def model_grid(self, s: Shape, deadline: float) -> None:
        args = self.args
        model = Model(s, self.device, self.dtype)
        k_max = max(args.ks)
        gen = torch.Generator(device="cpu").manual_seed(0)

        def tokens(batch, query):
            return torch.randint(0, s.vocab, (batch, query), generator=gen).to(self.device)

        def over() -> bool:
            if self.elapsed() >= deadline:
                self.stopped_early = True
            return self.stopped_early

        # context 0: decode at every batch the first-order verify price asks for, T(b·(k+1), 0)
        zero_batches = sorted(set(args.batches) | {2 ** i for i in range(int(math.log2(max(args.batches) * (k_max + 1))) + 2)
                                                   if 2 ** i > max(args.batches)})
        cells = [(b, 0) for b in zero_batches] + [(b, c) for c in args.contexts for b in args.batches]
        for batch, context in cells:
            if over():
                return
            slots = context + k_max + 1
            if not self.fits(model, batch, slots, s.layers + 1):
                self.skipped.append({"model": s.name, "batch": batch, "context": context, "why": "KV cache too large"})
                continue
            try:
                self.cell(model, batch, context, slots, tokens, over, zero_only=context == 0)
            except torch.cuda.OutOfMemoryError:
                self.skipped.append({"model": s.name, "batch": batch, "context": context, "why": "out of memory"})
            except RuntimeError as e:  # no backend ran a step here: keep the rest of the grid
                self.skipped.append({"model": s.name, "batch": batch, "context": context,
                                     "why": str(e).splitlines()[0][:300]})
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.write()

    def cell(self, model: Model, batch: int, context: int, slots: int, tokens, over, zero_only: bool) -> None:
        """Decode, verify at every k and draft at one (batch, context); the target's KV cache is
        freed before the draft layer's is made."""
        self.target_rows(model, batch, context, slots, tokens, over, zero_only)
        if zero_only or over():
            return
        s = model.s
        mtp_cache = model.new_cache(batch, slots, 1)
        hidden = torch.randn(batch, s.hidden, device=self.device, dtype=self.dtype)
        draft_in = tokens(batch, 1)
        self.rows.append(row(s.name, "draft", batch, context, 1, *self.measure(
            lambda be: model.draft_step(draft_in, hidden, mtp_cache, context, be), self.decode_backends)))

    def target_rows(self, model: Model, batch: int, context: int, slots: int, tokens, over, zero_only: bool) -> None:
        s = model.s
        cache = model.new_cache(batch, slots, s.layers)
        decode_in = tokens(batch, 1)
        self.rows.append(row(s.name, "decode", batch, context, 0, *self.measure(
            lambda be: model.target_step(decode_in, cache, context, be), self.decode_backends)))
        for k in () if zero_only else self.args.ks:
            if over():
                return
            verify_in = tokens(batch, k + 1)
            self.rows.append(row(s.name, "verify", batch, context, k, *self.measure(
                lambda be: model.target_step(verify_in, cache, context, be), self.verify_backends)))

    def run(self) -> None:
        shapes = TINY_SHAPES if self.args.tiny else SHAPES
        names = self.args.models or list(shapes)
        check_attention(self.device, self.dtype, self.verify_backends, self.decode_backends)
        for i, name in enumerate(names):
            share = (self.args.budget_s - self.elapsed()) / (len(names) - i)
            self.model_grid(shapes[name], self.elapsed() + share)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.stopped_early = self.stopped_early or self.elapsed() >= self.args.budget_s
        self.write()


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="verify_cost.json", help="JSON to write (rewritten after every grid point)")
    p.add_argument("--models", type=lambda t: t.split(","), help=f"shapes (default all): {', '.join(SHAPES)}")
    p.add_argument("--batches", type=_ints, help=f"requests per step (default {DEFAULT_BATCHES})")
    p.add_argument("--contexts", type=_ints, help=f"KV tokens per request (default {DEFAULT_CONTEXTS})")
    p.add_argument("--ks", type=_ints, help=f"draft tokens verified per request (default {DEFAULT_KS})")
    p.add_argument("--replays", type=int, default=30, help="timed replays per shape; the median is kept")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting measurements after this many seconds")
    p.add_argument("--memory-fraction", type=float, default=0.85, help="KV cache may take this much of free memory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, eager on CPU: a test of this script")
    args = p.parse_args(argv)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.models and set(args.models) - set(shapes):
        p.error(f"unknown model {sorted(set(args.models) - set(shapes))}; known: {', '.join(shapes)}")
    args.batches = args.batches or ((1, 2) if args.tiny else DEFAULT_BATCHES)
    args.contexts = args.contexts or ((16, 32) if args.tiny else DEFAULT_CONTEXTS)
    args.ks = args.ks or ((1, 2) if args.tiny else DEFAULT_KS)
    if args.tiny:
        args.replays = min(args.replays, 3)
    if min(args.batches) < 1 or min(args.ks) < 1 or min(args.contexts) < 1:
        p.error("batches, contexts and ks must be >= 1")
    if args.replays < 1 or args.budget_s <= 0:
        p.error("--replays must be >= 1 and --budget-s > 0")
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device: this measures a GPU (use --tiny to test the script on CPU)")
    return args


def main(argv=None) -> int:
    run = Run(parse_args(argv))
    run.run()
    kinds = {kind: sum(r["kind"] == kind for r in run.rows) for kind in ("decode", "verify", "draft")}
    print(f"wrote {run.args.out}: {kinds} rows, {len(run.skipped)} grid points skipped, "
          f"{'stopped by --budget-s' if run.stopped_early else 'grid complete'} after {run.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
