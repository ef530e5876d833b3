"""A multi-turn chat on a hybrid (recurrent) model resumes each turn from its history, not from token 0.

Each turn's prompt is the conversation so far (the previous prompt, its answer, a new user message), as a
chat template renders it. A recurrent state cannot drop the tokens after a shared prefix; the runner
restores the state checkpoint the previous prompt left at its end (kvcache/recurrent.py) and evaluates the
rest. What the runner's prompt cache supplied is what it reports as cached (Sequence: num_prompt_inputs
minus the inputs left to evaluate; serve's `prompt_cached_count`).

With exact reuse on (serve's default, OLLAMA_ENGINE_EXACT_CACHE), a hit must give a cold run's result
bitwise, so it resumes only where the rest's batch rows get a cold run's kernels (runner/exact.py); the one
checkpoint a short turn leaves (its prompt's end) is almost never such a place, and the whole history is
evaluated again: the strict xfail below records that open gap.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from synthetic.models import write_synthetic

from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import Piece, SequenceOptions
from ollama_engine.sample import Sampler

HYBRIDS = ["tiny-lfm2", "tiny-qwen35", "tiny-nemotron_h"]
TURNS = 4


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("hybrid-chat")

    def write(preset: str) -> Path:
        path = folder / f"{preset}-Q8_0.gguf"
        return path if path.exists() else write_synthetic(path, preset, weight_type="Q8_0")

    return write


def chat(path: Path, exact: bool) -> list[tuple[int, int]]:
    """(prompt inputs, cached inputs) of each turn of a greedy chat through the runner's batch loop."""
    loaded = open_model(str(path), LoadParams(parallel=1, batch_size=512, kv_size=1024, num_threads=1),
                        allocate=True)
    loaded.model.backend.load()
    loaded.input_cache.exact = exact
    errors: list[BaseException] = []
    runner = Runner(loaded, errors.append)
    runner.start()
    conversation, turns = "", []
    try:
        for turn in range(TURNS):
            conversation += f"<user> tell me about the old fisherman and his boat, day {turn}\n<assistant>"
            seq = runner.new_sequence(conversation, SequenceOptions(sampler=Sampler(temperature=0), num_predict=8))
            done, answer = threading.Event(), []

            def sink(piece: Piece | None, done: threading.Event = done, answer: list[str] = answer) -> None:
                if piece is None:
                    done.set()
                else:
                    answer.append(piece.text)

            runner.add(seq, sink)
            turns.append((seq.num_prompt_inputs, seq.num_prompt_inputs - len(seq.inputs)))
            assert done.wait(120), "the turn did not finish"
            conversation += "".join(answer) + "\n"
    finally:
        runner.close()
        loaded.close()
    assert not errors
    return turns


@pytest.mark.parametrize("preset", HYBRIDS)
def test_each_turn_resumes_after_the_previous_prompt(synthetic, preset):
    """Exact reuse off (Ollama's rule): every turn after the first reuses at least the whole previous prompt."""
    turns = chat(synthetic(preset), exact=False)
    assert turns[0][1] == 0
    for (previous, _), (prompt, cached) in zip(turns, turns[1:], strict=False):
        assert previous <= cached < prompt, turns


@pytest.mark.xfail(strict=True, reason="exact reuse finds no checkpoint a short turn can resume from (open gap)")
@pytest.mark.parametrize("preset", ["tiny-lfm2"])
def test_exact_reuse_resumes_a_chat_too(synthetic, preset):
    turns = chat(synthetic(preset), exact=True)
    assert all(cached > 0 for _, cached in turns[1:]), turns
