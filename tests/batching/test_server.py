"""The OpenAI-compatible HTTP example, queried with a real HTTP client (urllib) on loopback."""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infopt.batching import Engine, SamplingParams
from infopt.models import tiny_model
from tests.batching.helpers import start_queued

_PATH = Path(__file__).resolve().parents[2] / "examples" / "batching_server.py"


@pytest.fixture
def server(default_tokenizer):
    spec = importlib.util.spec_from_file_location("batching_server", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    engine = Engine(tiny_model(), default_tokenizer, max_seqs=8, max_batch_tokens=128).start()
    srv = mod.make_server(engine, "127.0.0.1", 0, model_name="tiny")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    host, port = srv.server_address[:2]
    yield f"http://{host}:{port}", engine, mod
    srv.shutdown()
    srv.server_close()
    engine.stop(cancel=True)


def _post(url, payload):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, r.read()


def test_completions_match_the_engine_and_follow_the_openai_shape(server, default_tokenizer):
    base, engine, _ = server
    status, raw = _post(base + "/v1/completions", {"prompt": ["Hello", "The cache is"], "max_tokens": 6,
                                                   "temperature": 0})
    body = json.loads(raw)
    assert status == 200 and body["object"] == "text_completion" and body["model"] == "tiny"
    want = Engine(tiny_model(), default_tokenizer).generate(["Hello", "The cache is"], SamplingParams(6))
    assert [c["text"] for c in body["choices"]] == [o.text for o in want]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in want)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    with urllib.request.urlopen(base + "/v1/models", timeout=60) as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"


def test_streamed_completion_is_server_sent_events(server):
    base, _, _ = server
    status, raw = _post(base + "/v1/completions", {"prompt": "Once upon", "max_tokens": 7, "temperature": 0})
    plain = json.loads(raw)["choices"][0]["text"]
    status, raw = _post(base + "/v1/completions", {"prompt": "Once upon", "max_tokens": 7, "temperature": 0,
                                                   "stream": True})
    lines = [ln for ln in raw.decode().split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) >= 2


def test_bad_requests_get_400_and_the_server_keeps_serving(server):
    base, engine, _ = server
    for payload, needle in (({"prompt": "", "max_tokens": 4}, "empty prompt"),
                            ({"prompt": "hi", "max_tokens": 0}, "max_new_tokens=0"),
                            ({"prompt": 5}, "'prompt' must be"),
                            ({"prompt": "hi", "temperature": -1}, "temperature")):
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(base + "/v1/completions", payload)
        assert e.value.code == 400
        assert needle in json.loads(e.value.read())["error"]["message"]
    status, _ = _post(base + "/v1/completions", {"prompt": "still here", "max_tokens": 3, "temperature": 0})
    assert status == 200


def test_concurrent_clients_share_engine_steps(server):
    base, engine, _ = server
    results = {}

    def client(i):
        results[i] = json.loads(_post(base + "/v1/completions", {"prompt": f"Item {i}", "max_tokens": 10,
                                                                 "temperature": 0})[1])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    start_queued(engine, threads, 6)
    assert len(results) == 6 and all(r["usage"]["completion_tokens"] == 10 for r in results.values())
    assert engine.metrics()["steps"] <= 11  # six 10-token requests decoded in the same steps
