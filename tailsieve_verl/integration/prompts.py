"""A prompt row's stable name: verl gives every fetch of a prompt a fresh uid, so the per-prompt
length record and the checkpoint's messages name a prompt by a digest of its chat messages. Its own
module because the trainer and the checkpoint both need it (neither imports the other for it)."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensordict import TensorDict


def plain(value):
    """Chat messages as plain lists and dicts, whatever container a fetch or a checkpoint left them in."""
    if hasattr(value, "tolist"):  # numpy arrays, tensordict's non-tensor stacks
        value = value.tolist()
    elif type(value).__name__ == "NonTensorData":
        value = value.data
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def prompt_key(row: TensorDict) -> str:
    """The prompt itself, stable across epochs and resumes: a digest of its chat messages, which key
    the per-prompt length record."""
    text = json.dumps(plain(row["raw_prompt"]), sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:20]
