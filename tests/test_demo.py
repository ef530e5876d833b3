"""`ollama-engine demo` end to end: serve started, a model created through the API, a chat streamed."""

from __future__ import annotations

import io
import re

from synthetic.models import write_synthetic

from ollama_engine import demo
from ollama_engine.demo import run_demo
from ollama_engine.fs.real_models import RealModelUnavailable
from ollama_engine.store import Store


def test_demo_on_a_synthetic_model(tmp_path):
    out = io.StringIO()
    model = write_synthetic(tmp_path / "tiny-llama.gguf", "tiny-llama")
    assert run_demo(str(model), name="synthetic", num_predict=8, out=out) == 0
    text = out.getvalue()
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


def _offline(monkeypatch, store_root):
    def fetch(name):
        raise RealModelUnavailable("no network")

    monkeypatch.setattr("ollama_engine.fs.real_models.fetch", fetch)
    monkeypatch.setattr(demo, "_store_root", lambda: store_root)


def test_demo_offline_uses_the_smallest_model_of_the_users_store(tmp_path, monkeypatch):
    store = Store(tmp_path / "models")
    for name, preset in (("big", "tiny-qwen2"), ("small", "tiny-llama")):
        path = write_synthetic(tmp_path / f"{name}.gguf", preset)
        store.create(name, files={path.name: store.add_file(path)})
    _offline(monkeypatch, store.root)
    out = io.StringIO()
    assert run_demo(None, num_predict=4, out=out) == 0
    text = out.getvalue()
    assert "offline: the real model could not be fetched (no network)" in text
    assert re.search(r"^model: small:latest from the store", text, re.M)
    assert re.search(r"^generated \d+ tokens", text, re.M)


def test_demo_offline_with_an_empty_store_asks_for_a_file(tmp_path, monkeypatch):
    _offline(monkeypatch, tmp_path / "empty")
    out = io.StringIO()
    assert run_demo(None, out=out) == 1
    assert "give a GGUF file (`ollama-engine demo PATH.gguf`)" in out.getvalue()


# ---------------------------------------------------------------- dev.py's set-up steps


def load_dev():
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))  # dev.py imports build_ggml from beside it
    try:
        spec = importlib.util.spec_from_file_location("dev_under_test", root / "dev.py")
        dev = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(dev)
    finally:
        sys.path.remove(str(root))
    return dev


def python_step(dev, title, code, log, **kwargs):
    import sys

    return dev.Step(title, title.split()[0], [[sys.executable, "-c", code]], log, **kwargs)


def test_dev_steps_one_line_each_whole_output_in_logs(tmp_path, capsys):
    dev = load_dev()
    first = python_step(dev, "first step", "print('[ 50%] half'); print('[100%] all')", tmp_path / "a.log")
    second = dev.Step("second step", "second", [["sh", "-c", "echo one"], ["sh", "-c", "echo two"]],
                      tmp_path / "b.log", after=[first])
    quiet = python_step(dev, "quiet step", "print('[build_ggml] up to date')", tmp_path / "c.log",
                        quiet_if=b"[build_ggml] up to date")
    dev.run_steps([second, first, quiet])
    err = capsys.readouterr().err.splitlines()
    assert sorted(re.sub(r"\d+ s$", "N s", line) for line in err) == [
        "[dev] first step ... done in N s", "[dev] second step ... done in N s"]
    assert first.started < first.ended <= second.started  # second came after first
    assert first.progress() == "100%"
    assert (tmp_path / "a.log").read_text().endswith("[ 50%] half\n[100%] all\n")
    log = (tmp_path / "b.log").read_text()  # both commands' output, each after its command line
    assert re.fullmatch(r"\$ sh -c 'echo one'\none\n\$ sh -c 'echo two'\ntwo\n", log)


def test_dev_failed_step_shows_its_log_tail_and_path_and_stops_the_others(tmp_path, capsys):
    import time

    import pytest

    dev = load_dev()
    slow = python_step(dev, "slow step", "import time; time.sleep(60)", tmp_path / "slow.log")
    never = python_step(dev, "never step", "print('ran')", tmp_path / "never.log", after=[slow])
    code = "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)"
    failing = python_step(dev, "failing step", code, tmp_path / "fail.log")
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        dev.run_steps([slow, never, failing])
    assert exit_.value.code == 3
    assert time.monotonic() - started < 30  # the slow step was stopped
    assert slow.proc.poll() is not None and never.proc is None
    err = capsys.readouterr().err
    assert re.search(r"^\[dev\] failing step \.\.\. failed \(exit code 3\) after \d+ s; the last 60 lines of its log:$",
                     err, re.M)
    assert "line 40\n" in err and "line 99\n" in err and "line 39\n" not in err  # the tail, in full
    assert f"[dev] the whole log: {tmp_path / 'fail.log'}" in err


def test_dev_reads_requirements_from_pyproject():
    dev = load_dev()
    assert dev.requirement("cffi") == ["cffi>=1.16"]
    test_extra = dev.requirement("", "test")
    assert "llama-cpp-python==0.3.36" in test_extra and any(spec.startswith("pytest") for spec in test_extra)


def test_dev_progress_from_make_and_ninja_lines(tmp_path):
    dev = load_dev()
    log = tmp_path / "x.log"
    step = dev.Step("x", "x", [["true"]], log)
    log.write_bytes(b"[ 10%] Building C object a.o\n")
    assert step.progress() == "10%"
    with log.open("ab") as f:  # pip -v indents the build's output; a line not yet ended is not read
        f.write(b"  [3/4] /usr/bin/g++ -c b.cpp\n[4/")
    assert step.progress() == "75%"


def test_demo_asks_a_vision_model_about_a_picture(tmp_path):
    """A model with a vision tower (Ollama's single file) is also asked about the demo's picture; the image's rows
    are in the prompt's count, and the memory table shows the tower's weights as their own row."""
    from synthetic.vision import VisionSpec, add_vision

    text = write_synthetic(tmp_path / "text.gguf", "gemma3", weight_type="F32")
    model = add_vision(text, tmp_path / "vision.gguf", VisionSpec())
    out = io.StringIO()
    assert run_demo(str(model), name="seeing", num_predict=4, out=out) == 0
    output = out.getvalue()
    assert re.search(r"^GET /api/tags: seeing:latest .*capabilities=\[.*'vision'.*\]$", output, re.M)
    assert re.search(r"^POST /api/chat \(streamed\), user: What is in this picture\?.* \[a 320x240 PNG", output, re.M)
    answers = re.findall(r"^assistant: (.+)$", output, re.M)
    assert len(answers) == 2 and answers[1].strip()
    tokens = re.search(r"^prompt: (\d+) tokens with the image's", output, re.M)
    assert tokens and int(tokens.group(1)) > 16  # VisionSpec's image is 16 rows
    assert re.search(r"^  vision weights\s+CPU\s+\d", output, re.M)


def test_demo_of_a_text_model_asks_no_image_question(tmp_path):
    out = io.StringIO()
    model = write_synthetic(tmp_path / "tiny-llama.gguf", "tiny-llama")
    assert run_demo(str(model), name="synthetic", num_predict=2, out=out) == 0
    assert "picture" not in out.getvalue() and "vision weights" not in out.getvalue()
