"""A minimal OpenAI-completions endpoint on 127.0.0.1 for protocol and parsing tests only.

It sleeps ``seconds_per_token × max_tokens`` per request so that longer requests return later, and
records every request body. No timing claim is ever made from it; those come from real vLLM.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAIServer:
    def __init__(self, models=("tiny",), max_model_len=1024, seconds_per_token=0.0005, short_by=0,
                 reject_over=None, metrics_text=None):
        self.models = list(models)
        self.max_model_len = max_model_len
        self.seconds_per_token = seconds_per_token
        self.short_by = short_by  # generate this many tokens fewer than forced (a misbehaving server)
        self.reject_over = reject_over  # answer HTTP 400 when prompt + max_tokens exceeds this
        self.metrics_text = metrics_text  # served at /metrics when given (else 404, as a non-vLLM server)
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": m, "max_model_len": fake.max_model_len} for m in fake.models]})
                elif self.path == "/metrics" and fake.metrics_text is not None:
                    data = fake.metrics_text.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif self.path == "/version":
                    self._send(200, {"version": "fake-0"})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    fake.bodies.append(body)
                if fake.reject_over is not None and len(body["prompt"]) + body["max_tokens"] > fake.reject_over:
                    self._send(400, {"error": "This model's maximum context length is exceeded"})
                    return
                time.sleep(fake.seconds_per_token * body["max_tokens"])
                tokens = body["max_tokens"] - fake.short_by
                self._send(200, {"choices": [{"text": "x" * tokens, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}})

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # a batch connects all at once

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
