"""`ollama-engine demo` end to end: serve started, a model created through the API, a chat streamed."""

from __future__ import annotations

import io
import re

from ollama_engine.demo import run_demo


def test_demo_on_a_synthetic_model():
    out = io.StringIO()
    assert run_demo(None, num_predict=8, out=out, real=False) == 0
    text = out.getvalue()
    assert "weights are random" in text
    assert re.search(r"^serve: listening on http://127\.0\.0\.1:\d+", text, re.M)
    assert re.search(r"^POST /api/blobs/sha256:\S+: 201 ", text, re.M)
    assert re.search(r"^  parsing GGUF\n(.*\n)*  writing manifest\n  success$", text, re.M)
    assert re.search(r"^GET /api/tags: synthetic:latest llama .* capabilities=\['completion'\]$", text, re.M)
    answer = re.search(r"^assistant: (.+)$", text, re.M)
    assert answer and answer.group(1).strip()
    assert re.search(r"^generated 8 tokens in \d+\.\d\d s: \d+\.\d tokens/s", text, re.M)
    assert re.search(r"^  synthetic:latest  state=idle  size=.* context=\d+", text, re.M)
    # the memory table: every kind of memory the runner reported, and the total
    for row in ("model weights", "kv cache", "compute graph", "total memory"):
        assert re.search(rf"^  {row}\b.*\d+(\.\d)? (B|KiB|MiB|GiB)$", text, re.M), row
