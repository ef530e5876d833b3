"""`ollama-engine demo` end to end: a synthetic model planned, loaded through a runner and run."""

from __future__ import annotations

import io
import re

from ollama_engine.demo import run_demo


def test_demo_on_a_synthetic_model():
    out = io.StringIO()
    assert run_demo(None, num_predict=8, out=out) == 0
    text = out.getvalue()
    assert "weights are random" in text
    assert re.search(r"^load: fit .*-> ok$", text, re.M)
    assert re.search(r"^load: commit .*-> ok$", text, re.M)
    assert "loading weights: 100%" in text
    # the memory table: every kind of memory the runner reported, and the total
    for row in ("model weights", "kv cache", "compute graph", "total memory"):
        assert re.search(rf"^  {row}\b.*\d+(\.\d)? (B|KiB|MiB|GiB)$", text, re.M), row
    layout = re.search(r"^layout: (\d)/3 layers on GPUs .*, (\d) on CPU$", text, re.M)
    assert layout and int(layout.group(1)) + int(layout.group(2)) == 3
    output = re.search(r"^output: (.+)$", text, re.M)
    assert output and output.group(1).strip()
    assert re.search(r"^generated 8 tokens in \d+\.\d\d s: \d+\.\d tokens/s", text, re.M)
