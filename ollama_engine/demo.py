"""`ollama-engine demo`: load a model through a runner the way a scheduler does, then stream a completion.

Every step is printed: the machine's memory and GPUs, each /load request of the fit → alloc → commit loop,
the load progress, the runner's memory table and the layer layout, and the generated text with its speed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import TextIO

from ollama_engine.fs import GGUFFile
from ollama_engine.fs.synthetic import write_synthetic
from ollama_engine.llm.discovery import discover_gpus, system_info
from ollama_engine.llm.load import Attempt, LoadOptions, load
from ollama_engine.llm.runner_handle import RunnerHandle
from ollama_engine.ml.memory import human_bytes2

PROMPT = "Once upon a time"
NUM_PREDICT = 32
NUM_CTX = 2048
SYNTHETIC_PRESET = "tiny-llama"


def run_demo(model: str | None, *, num_predict: int = NUM_PREDICT, out: TextIO = sys.stdout) -> int:
    """Plan, load and run `model` (a GGUF path), or a small synthetic model when None."""
    with tempfile.TemporaryDirectory(prefix="ollama-engine-demo-") as tmp:
        if model is None:
            model = str(write_synthetic(Path(tmp) / f"{SYNTHETIC_PRESET}.gguf", SYNTHETIC_PRESET))
            print(f"model: synthetic {SYNTHETIC_PRESET} at {model}", file=out)
            print("       (its weights are random: expect fluent-looking nonsense, not stories)", file=out)
        else:
            print(f"model: {model}", file=out)
        _demo(model, num_predict, out)
    return 0


def _demo(model: str, num_predict: int, out: TextIO) -> None:
    config = GGUFFile.open(model).config
    total_layers = config.get_uint("block_count") + 1
    train_ctx = config.get_uint("context_length", 0)
    num_ctx = min(NUM_CTX, train_ctx) if train_ctx > 0 else NUM_CTX
    options = LoadOptions(num_ctx=num_ctx, batch_size=min(512, num_ctx))

    system = system_info()
    print(f"system memory: total {human_bytes2(system.total_memory)}, free {human_bytes2(system.free_memory)}, "
          f"free swap {human_bytes2(system.free_swap)}, {system.thread_count} threads", file=out)

    with RunnerHandle.start(model) as runner:
        runner.wait_launched()
        print(f"runner: started on port {runner.port} (pid {runner.process.pid})", file=out)
        gpus = discover_gpus(runner)
        for gpu in gpus:
            print(f"gpu: {gpu.device_id.library} {gpu.device_id.id} {gpu.name} {gpu.description}: "
                  f"{human_bytes2(gpu.free_memory)} free of {human_bytes2(gpu.total_memory)}", file=out)
        if not gpus:
            print("gpu: none found, every layer stays on the CPU", file=out)

        def show(attempt: Attempt) -> None:
            outcome = "ok" if attempt.success else "does not fit"
            layers = str(attempt.gpu_layers) if attempt.gpu_layers.sum() else "[] (all on CPU)"
            print(f"load: {attempt.operation.name.lower():<6} layers={layers} backoff={attempt.backoff:.2f} "
                  f"-> {outcome}", file=out)

        print(f"planning {total_layers} layers (context {num_ctx}, batch {options.batch_size})", file=out)
        result = load(runner, system, gpus, total_layers, options, on_attempt=show)
        runner.wait_until_running(on_progress=lambda p: print(f"loading weights: {p:4.0%}", file=out))

        print("memory:", file=out)
        for line in result.memory.table().splitlines():
            print(f"  {line}", file=out)
        on_gpus = result.gpu_layers.sum()
        print(f"layout: {on_gpus}/{total_layers} layers on GPUs {result.gpu_layers}, "
              f"{total_layers - on_gpus} on CPU", file=out)

        print(f"prompt: {PROMPT}", file=out)
        print("output: ", end="", file=out, flush=True)
        final = {}
        for chunk in runner.completion(PROMPT, {"num_predict": num_predict, "temperature": 0}):
            print(chunk["content"], end="", file=out, flush=True)
            final = chunk
        print(file=out)
        seconds = final["eval_duration"] / 1e9
        rate = final["eval_count"] / seconds if seconds > 0 else float("inf")
        print(f"generated {final['eval_count']} tokens in {seconds:.2f} s: {rate:.1f} tokens/s "
              f"(prompt: {final['prompt_eval_count']} tokens)", file=out)
