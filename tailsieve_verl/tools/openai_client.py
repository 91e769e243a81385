"""Forced-length requests against a vLLM OpenAI-compatible server (stdlib only).

``calibrate`` and ``bench`` both need the same thing from a server: run a set of completions whose
response lengths are fixed in advance (``max_tokens == min_tokens`` and ``ignore_eos``), submit them
together, and record when each one finished. Prompts are token-id lists, so no tokenizer is involved
and the prompt length is exact.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

from ..core.errors import TailSieveError


class EndpointError(TailSieveError):
    """The server is unreachable, answered an error, or did not honour a forced length."""


@dataclass(frozen=True)
class ForcedRequest:
    """One completion: exact prompt tokens, exactly ``length`` generated tokens."""

    prompt_token_ids: tuple[int, ...]
    length: int


@dataclass(frozen=True)
class RequestTiming:
    """Seconds from the batch's common start until this request's response arrived."""

    finish_s: float
    completion_tokens: int


class OpenAIServer:
    """One server: ``url`` like ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted)."""

    def __init__(self, url: str, model: str | None = None, timeout_s: float = 600.0, temperature: float = 1.0):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointError(f"bad server URL {url!r}; expected http://HOST:PORT")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.temperature = temperature  # sampling temperature of every request (verl's rollout default: 1)
        served = {str(m.get("id")): m for m in self._call("GET", "/v1/models").get("data", [])}
        if model is None:
            if len(served) != 1:
                raise EndpointError(f"{self.url} serves {len(served)} models ({', '.join(served)}); "
                                    "name the one to use with --model")
            model = next(iter(served))
        elif model not in served:
            raise EndpointError(f"{self.url} does not serve {model!r}; it serves: {', '.join(served)}")
        self.model = model
        self.max_model_len: int | None = served[model].get("max_model_len")

    # -- HTTP ---------------------------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout_s)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        text = self._text(method, path, body)
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise EndpointError(f"{self.url}{path} did not answer JSON: {text[:200]!r}") from None

    def _text(self, method: str, path: str, body: dict | None = None) -> str:
        conn = self._connection()
        try:
            payload = None if body is None else json.dumps(body)
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, self._prefix + path, body=payload, headers=headers)
            response = conn.getresponse()
            text = response.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as e:
            raise EndpointError(f"cannot reach the server at {self.url} ({e}); start a vLLM OpenAI server "
                                "there (e.g. `vllm serve MODEL --port PORT`) or fix --url") from None
        finally:
            conn.close()
        if response.status != 200:
            raise EndpointError(f"{self.url}{path} answered HTTP {response.status}: {text[:300]}")
        return text

    def metrics_text(self) -> str:
        """The server's Prometheus ``/metrics`` text (vLLM serves it beside the OpenAI routes)."""
        return self._text("GET", "/metrics")

    def version(self) -> str:
        """The server's vLLM version, or "unknown" when it does not expose /version."""
        try:
            return str(self._call("GET", "/version").get("version", "unknown"))
        except EndpointError:
            return "unknown"

    # -- requests -----------------------------------------------------------------------------
    def complete(self, request: ForcedRequest) -> int:
        """Run one forced-length completion; returns the generated token count (checked)."""
        if request.length < 1:
            raise EndpointError(f"a forced length must be >= 1 token, got {request.length}")
        body = {
            "model": self.model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.length,
            "min_tokens": request.length,
            "ignore_eos": True,
            "temperature": self.temperature,
            "stream": False,
        }
        answer = self._call("POST", "/v1/completions", body)
        tokens = int(answer.get("usage", {}).get("completion_tokens", -1))
        if tokens != request.length:
            raise EndpointError(f"{self.url} generated {tokens} tokens where {request.length} were forced; "
                                "the server must honour ignore_eos/min_tokens (a vLLM OpenAI server does)")
        return tokens

    def run_together(self, requests: Sequence[ForcedRequest]) -> list[RequestTiming]:
        """Submit all requests at once (one thread each, released by one barrier; submission order
        is the list order to within thread start-up) and wait for all. Times are from the release."""
        timings: list[RequestTiming | None] = [None] * len(requests)
        errors: list[BaseException] = []
        gate = threading.Barrier(len(requests) + 1)
        start = [0.0]

        def worker(i: int, request: ForcedRequest) -> None:
            gate.wait()
            try:
                tokens = self.complete(request)
                timings[i] = RequestTiming(time.perf_counter() - start[0], tokens)
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i, r), daemon=True) for i, r in enumerate(requests)]
        for t in threads:
            t.start()
        start[0] = time.perf_counter()
        gate.wait()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [t for t in timings if t is not None]


# Token ids used for synthetic prompts: clear of the low special-token ids, and inside any real
# vocabulary (the tiny test tokenizer has 2,048 entries).
PROMPT_TOKEN_RANGE = (100, 1100)


def synthetic_prompt(prompt_len: int, key: object) -> tuple[int, ...]:
    """A deterministic prompt of ``prompt_len`` (>= 1) token ids, distinct per ``key``.

    Distinct keys give unrelated prompts, so a server's prefix cache only hits where a caller
    reuses a key on purpose (the n samples of one group)."""
    rng = random.Random(repr(key))
    low, high = PROMPT_TOKEN_RANGE
    return tuple(rng.randrange(low, high) for _ in range(max(1, int(prompt_len))))
