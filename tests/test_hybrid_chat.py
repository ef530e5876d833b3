"""A multi-turn chat on a hybrid (recurrent) model resumes each turn from its history, not from token 0.

Each turn's prompt is the conversation so far (the previous prompt, its answer, a new user message), as a
chat template renders it. A recurrent state cannot drop the tokens after a shared prefix; the runner
restores a state checkpoint the previous prompt left (kvcache/recurrent.py) and evaluates the rest. What the
runner's prompt cache supplied is what it reports as cached (Sequence: num_prompt_inputs minus the inputs
left to evaluate; serve's `prompt_cached_count`).

With exact reuse on (serve's default, OLLAMA_ENGINE_EXACT_CACHE), a hit must give a cold run's result
bitwise, so it resumes only where the rest's batch rows get a cold run's kernels (runner/exact.py): the
previous prompt's last multiple of 4 when the turn adds at least 64 inputs, 64 inputs earlier when it adds
fewer (the rows evaluated again must reach the tiled attention a cold run gives them). The batch that ends a
prompt keeps the recurrent state at both places (runner/exact.extension_resumes), its recurrent op run in
pieces that give one call's numbers: the resumed turn answers as a cold run does, alone and beside another
sequence. The generated answer is evaluated again (its rows were one-row batches, never a cold run's).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from synthetic.models import write_synthetic
from test_batch_invariance import logprob_gap

from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import Piece, SequenceOptions
from ollama_engine.sample import Sampler

HYBRIDS = ["tiny-lfm2", "tiny-lfm2moe", "tiny-qwen3next", "tiny-qwen35", "tiny-qwen35moe", "tiny-nemotron_h",
           "tiny-nemotron_h_moe"]
TURNS = 4
SYSTEM = "<system> you are a patient storyteller who answers in short plain sentences about the sea\n" * 3
SHORT = "<user> tell me about the old fisherman and his boat, day {}\n<assistant>"  # under 64 inputs a turn
LONG = "<user> " + "and then what did the old fisherman do with his boat and his nets that day " * 3 + "{}\n<assistant>"
BESIDE = "Once upon a time there was a king who ruled a small island far out in the grey northern sea"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("hybrid-chat")

    def write(preset: str) -> Path:
        path = folder / f"{preset}-Q8_0.gguf"
        return path if path.exists() else write_synthetic(path, preset, weight_type="Q8_0")

    return write


@dataclass
class Turn:
    prompt: str
    inputs: int  # the prompt's inputs
    cached: int  # of which the prompt cache supplied
    answer: list[dict]  # token, logprob, top_logprobs of each generated token
    text: list[str]  # the answer's pieces


class Chat:
    """A runner of the model with its batch loop started; `ask` runs one greedy completion."""

    def __init__(self, path: Path, exact: bool, parallel: int = 1):
        self.loaded = open_model(str(path), LoadParams(parallel=parallel, batch_size=512, kv_size=1024 * parallel,
                                                       num_threads=1), allocate=True)
        self.loaded.model.backend.load()
        self.loaded.input_cache.exact = exact
        self.errors: list[BaseException] = []
        self.runner = Runner(self.loaded, self.errors.append)
        self.runner.start()

    def ask(self, prompt: str, num_predict: int = 8) -> tuple[Turn, threading.Event]:
        options = SequenceOptions(sampler=Sampler(temperature=0), num_predict=num_predict, logprobs=True,
                                  top_logprobs=3)
        seq = self.runner.new_sequence(prompt, options)
        done, entries, text = threading.Event(), [], []

        def sink(piece: Piece | None) -> None:
            if piece is None:
                done.set()
            else:
                text.append(piece.text)
                entries.extend({"token": e["token"], "logprob": e["logprob"], "top_logprobs": e["top_logprobs"]}
                               for e in piece.logprobs)

        self.runner.add(seq, sink)
        return Turn(prompt, seq.num_prompt_inputs, seq.num_prompt_inputs - len(seq.inputs), entries, text), done

    def close(self) -> None:
        self.runner.close()
        self.loaded.close()
        assert not self.errors


def wait(done: threading.Event) -> None:
    assert done.wait(120), "the completion did not finish"


def chat(path: Path, exact: bool, message: str = SHORT, system: str = "", beside: bool = False) -> list[Turn]:
    """Each turn of a greedy chat through the runner's batch loop; with `beside`, another sequence decodes in the
    batches that evaluate each turn's prompt."""
    runner = Chat(path, exact, parallel=2 if beside else 1)
    conversation, turns = system, []
    try:
        for turn in range(TURNS):
            conversation += message.format(turn)
            other = runner.ask(BESIDE, num_predict=24)[1] if beside else None
            asked, done = runner.ask(conversation)
            wait(done)
            if other is not None:
                wait(other)
            turns.append(asked)
            conversation += "".join(asked.text) + "\n"
    finally:
        runner.close()
    return turns


def cold(path: Path, prompts: list[str]) -> list[list[dict]]:
    """Each prompt's answer from a runner that has seen nothing else."""
    answers = []
    for prompt in prompts:
        runner = Chat(path, exact=True)
        try:
            turn, done = runner.ask(prompt)
            wait(done)
            assert turn.cached == 0
            answers.append(turn.answer)
        finally:
            runner.close()
    return answers


@pytest.mark.parametrize("preset", HYBRIDS)
def test_each_turn_resumes_after_the_previous_prompt(synthetic, preset):
    """Exact reuse off (Ollama's rule): every turn after the first reuses at least the whole previous prompt."""
    turns = chat(synthetic(preset), exact=False)
    assert turns[0].cached == 0
    for previous, turn in zip(turns, turns[1:], strict=False):
        assert previous.inputs <= turn.cached < turn.inputs, [(t.inputs, t.cached) for t in turns]


@pytest.mark.parametrize("preset", HYBRIDS)
@pytest.mark.parametrize(("message", "back"), [(LONG, 0), (SHORT, 64)], ids=["long-turns", "short-turns"])
def test_exact_reuse_resumes_a_chat_where_a_cold_run_allows(synthetic, preset, message, back):
    """Exact reuse on: each turn reuses the previous prompt but for its last `inputs % 4` (turns of 64 inputs or
    more), or 64 inputs fewer (shorter turns), and answers bitwise as a cold run of the same prompt does."""
    path = synthetic(preset)
    turns = chat(path, exact=True, message=message, system=SYSTEM)
    shape = [(t.inputs, t.cached) for t in turns]
    assert turns[0].inputs >= 64 + 4 and turns[0].cached == 0, shape
    for previous, turn in zip(turns, turns[1:], strict=False):
        added = turn.inputs - previous.inputs
        assert (added >= 64) == (back == 0), shape  # the case this parameter is about
        assert turn.cached == previous.inputs - previous.inputs % 4 - back > 0, shape
    answers = cold(path, [t.prompt for t in turns])
    for turn, answer in zip(turns, answers, strict=True):
        assert logprob_gap(answer, turn.answer) == 0.0, turn.prompt


@pytest.mark.parametrize("preset", HYBRIDS)
def test_a_resumed_turn_beside_another_sequence_answers_as_a_cold_run(synthetic, preset):
    """Two slots: another sequence's rows share the batches that evaluate each turn's prompt; the turns still
    resume and answer bitwise as cold runs alone do. (The other rows move the batch's last `rows % 4`, the
    one-row matmul's: up to 3 more of the previous prompt's last inputs are not a cold run's, 4 fewer reused.)"""
    path = synthetic(preset)
    turns = chat(path, exact=True, message=LONG, system=SYSTEM, beside=True)
    for previous, turn in zip(turns, turns[1:], strict=False):
        last = previous.inputs - previous.inputs % 4
        assert turn.cached in (last, last - 4), [(t.inputs, t.cached) for t in turns]
    for turn, answer in zip(turns, cold(path, [t.prompt for t in turns]), strict=True):
        assert logprob_gap(answer, turn.answer) == 0.0, turn.prompt
