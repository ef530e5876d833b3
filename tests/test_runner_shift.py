"""Long generations through context shifts on the real runner, and what happens when a model computes NaN.

A context shift is computed by the batch builder's thread while the compute thread samples from the
previous batch: the logits must have been copied out of the backend's compute buffers before the shift's
graph reuses them (issue 38: the runner died with "logits sum to NaN" after the first shift).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from synthetic.models import write_synthetic
from test_runner_e2e import Client, free_port, start_runner

from ollama_engine.fs.gguf_file import GGUFFile
from ollama_engine.tokenizer import from_metadata

LOAD = {
    "Operation": 0, "LoraPath": None, "Parallel": 2, "BatchSize": 512, "FlashAttention": 0,
    "KvSize": 1024, "KvCacheType": "", "NumThreads": 2, "GPULayers": None,
    "MultiUserCache": False, "ProjectorPath": "", "MainGPU": 0, "UseMmap": False,
}


def loaded_runner(model: Path, **changes):
    port = free_port()
    proc = start_runner(model, port)
    client = Client(port)
    for operation in (0, 1, 2):
        assert client.json("POST", "/load", {**LOAD, **changes, "Operation": operation})["Success"]
    while client.json("GET", "/health")["status"] != 0:
        pass
    return proc, client


def stream(client: Client, body: dict) -> list[dict]:
    status, data = client.request("POST", "/completion", body)
    assert status == 200, data
    return [json.loads(line) for line in data.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("flash", [0, 1])
def test_generations_past_several_shifts_with_company(stories_path: Path, flash: int):
    """Two sequences of 1 300 sampled tokens in slots of 512: each shifts twice while the other decodes."""
    proc, client = loaded_runner(stories_path, FlashAttention=flash)
    try:
        def generate(seed: int) -> list[dict]:
            return stream(client, {"Prompt": "Once upon a time", "Grammar": "", "Shift": True, "Logprobs": False,
                                   "Options": {"num_predict": 1300, "temperature": 0.8, "seed": seed}})

        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(generate, [1, 2]))
        for lines in runs:
            assert "error" not in lines[-1], lines[-1]
            assert lines[-1]["done"] and lines[-1]["eval_count"] == 1300
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def _poison_token_embedding(path: Path, tokens: list[int]) -> None:
    """Write NaN into rows of token_embd.weight (F32) in place: a sequence that reads one computes NaN."""
    file = GGUFFile.open(path)
    tensor = file.tensors["token_embd.weight"]
    row = tensor.shape[0] * 4
    with path.open("r+b") as f:
        for token in tokens:
            f.seek(tensor.offset + token * row)
            f.write(np.full(tensor.shape[0], np.nan, dtype=np.float32).tobytes())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_end_only_their_sequence(tmp_path: Path, temperature: float):
    model = write_synthetic(tmp_path / "llama.gguf", "llama", n_embd=64, n_ff=128, n_layer=2, n_head=4, n_head_kv=2)
    tokenizer = from_metadata(GGUFFile.open(model).metadata)
    healthy, poisoned = "Once upon a time", "zebra"
    _poison_token_embedding(model, sorted(set(tokenizer.encode(poisoned, add_special=False))
                                          - set(tokenizer.encode(healthy, add_special=False))))
    proc, client = loaded_runner(model)
    try:
        def generate(prompt: str) -> list[dict]:
            return stream(client, {"Prompt": prompt, "Shift": True,
                                   "Options": {"num_predict": 200, "temperature": temperature, "seed": 1}})

        with ThreadPoolExecutor(2) as pool:
            good, bad = pool.map(generate, [healthy, poisoned])
        assert bad[-1] == {"error": bad[-1]["error"]} and "sample:" in bad[-1]["error"]
        assert good[-1]["done"] and "error" not in good[-1]
        assert proc.poll() is None and client.json("GET", "/health")["status"] == 0
        again = generate(healthy)  # the runner goes on serving
        assert again[-1]["done"] and "error" not in again[-1]
    finally:
        proc.kill()
        proc.wait()
