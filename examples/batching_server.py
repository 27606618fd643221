"""Serve a Hugging Face model over HTTP with an OpenAI-compatible ``/v1/completions`` route, standard library only.

Every HTTP request becomes an engine request, so concurrent clients share the engine's steps
(continuous batching). ``"stream": true`` answers with server-sent events, one chunk per text piece.

    python examples/batching_server.py --port 8000          # the embedded default model
    curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 16,
                                            "temperature": 0}'

``--tiny`` serves a tiny random model (for tests); ``--selftest`` starts the server on a free loopback
port, sends one plain and one streamed completion with ``urllib`` and exits.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from infopt.batching import Engine, SamplingParams


def _params(body: dict[str, Any]) -> SamplingParams:
    stop = body.get("stop") or ()
    return SamplingParams(
        max_new_tokens=body.get("max_tokens", 16),
        temperature=float(body.get("temperature", 1.0)),  # the OpenAI default
        top_p=float(body.get("top_p", 1.0)),
        top_k=int(body.get("top_k", 0)),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        seed=body.get("seed"),
    )


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8000, model_name: str = "infopt"):
    """A ``ThreadingHTTPServer`` answering ``POST /v1/completions`` and ``GET /v1/models`` from ``engine``
    (whose background thread must be running: ``engine.start()``)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _json(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str) -> None:
            self._json(code, {"error": {"message": message, "type": "invalid_request_error", "code": code}})

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/completions":
                return self._error(404, f"no route {self.path}")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                prompts = body.get("prompt")
                prompts = [prompts] if isinstance(prompts, str) else prompts
                if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
                    raise ValueError("'prompt' must be a non-empty string or a list of strings")
                if body.get("stream") and len(prompts) != 1:
                    raise ValueError("streaming serves one prompt per request")
                params = _params(body)
                handles = [engine.submit(p, params) for p in prompts]
            except (ValueError, TypeError, json.JSONDecodeError) as e:  # bad input: 400, the engine keeps serving
                return self._error(400, str(e))
            cid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())
            if body.get("stream"):
                return self._stream(handles[0], cid, created)
            outs = [h.result() for h in handles]
            prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
            completion_tokens = sum(len(o.token_ids) for o in outs)
            self._json(200, {
                "id": cid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"text": o.text, "index": i, "logprobs": None,
                             "finish_reason": "stop" if o.finish_reason == "stop" else "length"}
                            for i, o in enumerate(outs)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens},
            })

        def _stream(self, handle, cid: str, created: int) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()

            def send(choice: dict[str, Any]) -> None:
                chunk = {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": [choice]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()

            try:
                for piece in handle.stream(text=True):
                    send({"text": piece, "index": 0, "logprobs": None, "finish_reason": None})
                out = handle.result()
                send({"text": "", "index": 0, "logprobs": None,
                      "finish_reason": "stop" if out.finish_reason == "stop" else "length"})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client left: stop generating for it
                handle.cancel()
            self.close_connection = True

    return ThreadingHTTPServer((host, port), Handler)


def post(url: str, payload: dict[str, Any]) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (fast, for tests)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--selftest", action="store_true", help="serve on a free port, query it once, exit")
    args = ap.parse_args()
    if args.tiny:
        from infopt.models import load_default_tokenizer, tiny_model

        model, tok, name = tiny_model(), load_default_tokenizer(), "tiny-llama"
    else:
        from infopt.models import load_default

        (model, tok), name = load_default(), "SmolLM2-135M-Instruct"
    engine = Engine(model, tok, max_seqs=32, max_batch_tokens=256).start()
    server = make_server(engine, args.host, 0 if args.selftest else args.port, model_name=name)
    host, port = server.server_address[:2]
    if not args.selftest:
        print(f"serving {name} on http://{host}:{port}/v1/completions (Ctrl-C stops)")
        try:
            server.serve_forever()
        finally:
            engine.stop(cancel=True)
        return
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://{host}:{port}/v1/completions"
    body = json.loads(post(url, {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}))
    print("completion:", repr(body["choices"][0]["text"]), body["usage"])
    raw = post(url, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}).decode()
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in raw.splitlines()
              if line.startswith("data: {")]
    print("streamed:", repr("".join(pieces)), f"({len(pieces)} events)")
    server.shutdown()
    engine.stop(cancel=True)


if __name__ == "__main__":
    main()
