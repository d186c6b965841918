"""tools/soak.py's request mix and its KV-cache fill, against a stand-in HTTP server."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tools import soak


class _Completions(BaseHTTPRequestHandler):
    """Counts three prompt tokens a word and refuses an empty prompt, as the server does."""

    prompts: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        self.prompts.append(prompt)
        tokens = 3 * len(prompt.split())
        status, payload = 200, {"usage": {"prompt_tokens": tokens}}
        if tokens == 0:
            status, payload = 400, {"error": {"message": "the prompt is empty"}}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # noqa: ANN002 - silence the per-request lines
        pass


def test_the_fill_sends_no_empty_prompt_and_reaches_its_total(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    _Completions.prompts = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # 2,000 tokens: five prompts of 399, then 5 left, then 2 (fewer than a word's 3).
        soak.fill_kv_cache("127.0.0.1", server.server_address[1], 2000, None)
    finally:
        server.shutdown()
    out = capsys.readouterr().out
    assert "refused" not in out
    assert "filled the KV cache with 2001 prompt tokens" in out
    assert all(prompt.strip() for prompt in _Completions.prompts)


def test_the_mix_takes_every_sampling_path_and_some_invalid_requests():
    rng = random.Random(0)
    bodies = [soak._request_body(rng)[1] for _ in range(2000)]
    invalid = [b for b in bodies if b.get("max_tokens") == -1]
    valid = [b for b in bodies if b.get("max_tokens") != -1]
    assert 40 < len(invalid) < 160
    defaults = [b for b in valid if "temperature" not in b]
    candidates = [b for b in valid if b.get("top_k") == 20]
    penalised = [b for b in valid if "presence_penalty" in b]
    seeded = [b for b in valid if "seed" in b]
    edited = [b for b in valid if "logit_bias" in b and "min_tokens" in b]
    tools = [b for b in valid if "tools" in b]
    constrained = [b for b in valid if set(soak._CONSTRAINT_FIELDS) & set(b)]
    forced = [b for b in valid if "tool_choice" in b]
    for share in (defaults, candidates, penalised, seeded, edited, tools, constrained):
        assert len(share) > 40
    assert len(forced) > 10
    assert any(b.get("guided_regex") == "[0-9" for b in constrained)
    assert all(b["min_tokens"] <= b["max_tokens"] for b in edited)
    assert not any("top_k" in b or "presence_penalty" in b for b in defaults)
