"""N-gram speculative decoding gives exactly the tokens and logprobs of plain decoding, on real weights.

Each case runs the same requests through a runner twice, without and with `spec_ngram`, and compares every
token and logprob (and the top alternatives) for equality, not closeness: the verified rows must compute
what one-row decode steps compute (runner/speculate.py). Each case also checks that drafts were accepted,
so that a speculation that silently never happens cannot pass. Prompts ask to copy text, so the output
repeats the prompt and the drafts are mostly right, but not always (rejections and rollbacks happen too).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ollama_engine.ml import DType
from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import SequenceOptions
from ollama_engine.runner.speculate import (
    MAX_DRAFT,
    ROWS_ANY,
    ROWS_QUANTIZED,
    ROWS_REPACKED,
    NgramIndex,
    Speculator,
    StepCost,
    matmul_row_limits,
    verify_rows,
)
from ollama_engine.sample import Sampler, format_grammar
from ollama_engine.sample.grammar_text import GRAMMAR_JSON

TEXT = ("The lighthouse stood on a rock at the mouth of the bay. Every night the keeper climbed the hundred "
        "and twelve steps, trimmed the wick, wound the clockwork and watched the beam sweep across the water. "
        "Ships passed in the dark, and none of them ever knew his name.")
COPY = f"<|im_start|>user\nCopy this text exactly:\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"
JSON_PROMPT = f"<|im_start|>user\nWrite {TEXT!r} as a JSON object with a key text.<|im_end|>\n<|im_start|>assistant\n"
OTHERS = ["Once upon a time there was a cat", "List the planets of the solar system:", COPY.replace("exactly", "")]


class Run:
    """One completion through the batch loop: its logprobs, done reason and speculation record."""

    def __init__(self, runner: Runner, prompt: str, spec: bool, grammar: str = "", **options: Any) -> None:
        done, self.entries = threading.Event(), []

        def sink(piece) -> None:
            if piece is None:
                done.set()
            else:
                self.entries.extend(piece.logprobs)

        options.setdefault("sampler", Sampler(temperature=0))
        seq_options = SequenceOptions(logprobs=True, top_logprobs=3, spec_ngram=spec, **options)
        self.seq = runner.new_sequence(prompt, seq_options, grammar)
        runner.add(self.seq, sink)
        assert done.wait(900), "the completion did not finish"
        assert self.seq.error is None, self.seq.error

    @property
    def logprobs(self) -> list[tuple]:
        return [(e["token"], e["logprob"], tuple((t["token"], t["logprob"]) for t in e["top_logprobs"]))
                for e in self.entries]

    @property
    def text(self) -> str:
        return "".join(e["token"] for e in self.entries)


class CheapRows(StepCost):
    """Step costs as a memory-bound machine has them (each extra row a tenth of a step), whatever this machine's
    load: exactness is what these tests check, so they must speculate wherever drafts are found."""

    def record(self, rows: int, seconds: float) -> None:
        pass

    def estimate(self, rows: int) -> float:
        return 1.0 + 0.1 * (rows - 1)


def open_runner(path: Path, parallel: int = 1, kv_size: int = 2048, flash: bool = True,
                batch_size: int = 64) -> tuple[Runner, Any]:
    params = LoadParams(parallel=parallel, batch_size=batch_size, kv_size=kv_size, num_threads=2,
                        flash_attention=int(flash))
    loaded = open_model(str(path), params, allocate=True)
    loaded.model.backend.load()
    runner = Runner(loaded, lambda err: pytest.fail(f"runner failed: {err}"))
    runner.step_cost = CheapRows()
    runner.start()
    return runner, loaded


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request, smollm2_path: Path, gemma3_path: Path) -> Path:
    return {"smollm2": smollm2_path, "gemma3": gemma3_path}[request.param]


@pytest.fixture(scope="module", params=[True, False], ids=["flash", "matmul"])
def runner(request, model):
    runner, loaded = open_runner(model, parallel=3, flash=request.param)
    yield runner
    runner.close()
    loaded.close()


def assert_accepted(*runs: Run) -> None:
    spec = [run.seq.spec for run in runs]
    assert all(s is not None for s in spec)
    assert sum(s.accepted for s in spec) > 0, "no draft was accepted: speculation did not happen"


# ---------------------------------------------------------------- units


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    index = NgramIndex([1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 7])
    for token in (1, 2, 3):
        index.append(token)
    assert index.draft(3) == [6, 7, 1]  # the latest (1, 2, 3) is followed by 6, 7, 1
    index.append(8)
    assert index.draft(3) == []


def test_the_draft_length_follows_acceptance_and_cost():
    cost = StepCost()
    spec = Speculator.of([1, 2, 3] * 4, max_draft=6)
    assert spec.propose(6, cost) == [1] and spec.want  # nothing measured yet: one token
    for rows in range(1, 8):  # each extra row costs a fifth of a step: memory-bound decoding
        cost.record(rows, 1.0 + 0.2 * (rows - 1))
    for _ in range(5):
        spec.record(6, 6)
    assert spec.worth(6, cost) == 6  # every draft kept: as many as allowed
    for rows in range(1, 8):  # each extra row costs a whole step: compute-bound, nothing can pay
        for _ in range(StepCost.WINDOW):
            cost.record(rows, float(rows))
    assert spec.worth(6, cost) == 0
    for rows in range(1, 8):  # each extra row costs half a step
        for _ in range(StepCost.WINDOW):
            cost.record(rows, 1.0 + 0.5 * (rows - 1))
    assert spec.worth(6, cost) == 6
    for _ in range(10):
        spec.record(4, 0)  # drafts rejected: a third of a draft token kept does not pay for half a step
    assert spec.worth(6, cost) == 0
    assert spec.propose(6, cost) == [] and not spec.want  # and the sequence pauses
    assert spec.propose(6, cost) == [] and spec.acceptance == 30 / 70


def test_one_slow_step_does_not_turn_speculation_off():
    """Step costs are medians of recent steps: a 7-row step that took ten times as long once (a busy moment)
    leaves the estimate where the other steps put it, so speculation that pays goes on."""
    cost = StepCost()
    for rows in range(1, 8):
        for _ in range(4):
            cost.record(rows, 1.0 + 0.2 * (rows - 1))
    cost.record(7, 22.0)
    assert cost.estimate(7) == pytest.approx(2.2)
    spec = Speculator.of([1, 2, 3] * 4, max_draft=6)
    for _ in range(5):
        spec.record(6, 6)
    assert spec.worth(6, cost) == 6


def test_verify_rows_follow_the_kernels(runner):
    """Dense models verify up to 17 rows whatever their weights: a verify graph cuts each product to its limit."""
    assert verify_rows(runner.model) == ROWS_ANY == 17


def test_matmul_row_limits_by_weight(runner):
    """Repacked weights (Gemma's Q4_K on x86/ARM) take 3 rows a product, K-quants not repacked 7; SmolLM2's Q4_1,
    Gemma's Q5_0 and both models' Q8_0 compute any row as a one-row product does: no limit."""
    backend = runner.model.backend
    limits = matmul_row_limits(runner.model)
    repacked = backend.repacked_weights()
    for name, weight in backend.weights.items():
        if len(weight.ne) < 2 or weight.ne[1] == 1:
            continue
        expected = (ROWS_REPACKED if name in repacked else ROWS_QUANTIZED if weight.dtype in (DType.Q4_K, DType.Q6_K)
                    else None)
        assert limits.get(weight.storage) == expected, name


def test_a_mixture_keeps_the_cap_of_its_tightest_weight():
    """A mixture's experts are computed by matmul_id, which groups rows by expert: no product can be cut, so the
    whole batch stays within every weight's limit."""
    def weight(dtype: DType, *ne: int) -> SimpleNamespace:
        return SimpleNamespace(dtype=dtype, ne=(*ne, 1, 1, 1)[:4], storage=object())

    def model(weights: dict, repacked: set) -> SimpleNamespace:
        backend = SimpleNamespace(weights=weights, repacked_weights=lambda: repacked, block_count=1,
                                  layer_device=lambda i: SimpleNamespace(is_gpu=False))
        return SimpleNamespace(backend=backend, cache=object())

    dense = {"attn_q": weight(DType.Q4_K, 64, 64), "output": weight(DType.Q8_0, 64, 100)}
    experts = {**dense, "ffn_up_exps": weight(DType.Q4_K, 64, 128, 4)}
    assert verify_rows(model(dense, {"attn_q"})) == ROWS_ANY
    assert verify_rows(model(experts, {"attn_q", "ffn_up_exps"})) == ROWS_REPACKED
    assert verify_rows(model(experts, set())) == ROWS_QUANTIZED
    experts["ffn_down_exps"] = weight(DType.Q4_0, 128, 64, 4)  # not repacked: its many-row kernel is unchecked
    assert verify_rows(model(experts, set())) == 1  # no speculation


# ---------------------------------------------------------------- exactness


def test_greedy_alone(runner):
    plain = Run(runner, COPY, False, num_predict=60)
    spec = Run(runner, COPY, True, num_predict=60)
    assert spec.logprobs == plain.logprobs
    assert spec.seq.done_reason == plain.seq.done_reason
    assert_accepted(spec)


def test_greedy_with_long_drafts(runner):
    """Up to 16 drafts a step (32 asked): batches of 9 to 17 rows, past the sizes where other kernels take over, on a
    history past 512 cells (where the attention's kernels split long histories)."""
    if verify_rows(runner.model) <= ROWS_QUANTIZED:
        pytest.skip("this model's row cap keeps verify batches below 8 rows")
    prompt = COPY.replace(TEXT, " ".join([TEXT] * 10))
    assert len(runner.model.tokenizer.encode(prompt)) > 512
    plain = Run(runner, prompt, False, num_predict=60)
    spec = Run(runner, prompt, True, num_predict=60, draft_num_predict=MAX_DRAFT)
    assert spec.logprobs == plain.logprobs
    assert_accepted(spec)
    assert spec.seq.spec.drafted > 8 * spec.seq.spec.steps / 2, "the verify batches stayed small"


def test_greedy_batched_with_other_sequences(runner):
    """Three sequences at once, each speculating, against each alone without speculation."""
    if runner.model.backend.repacked_weights():
        pytest.skip("repacked weights: prompts batched together differ from solo without speculation too "
                    "(README, Numerics); speculation alone is checked by the other cases")
    prompts = [COPY, *OTHERS[:2]]
    alone = [Run(runner, p, False, num_predict=40) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: Run(runner, p, True, num_predict=40), prompts))
    for a, b in zip(alone, together, strict=True):
        assert b.logprobs == a.logprobs
    assert_accepted(*together)


def test_greedy_with_a_json_grammar(runner):
    plain = Run(runner, JSON_PROMPT, False, GRAMMAR_JSON, num_predict=80)
    spec = Run(runner, JSON_PROMPT, True, GRAMMAR_JSON, num_predict=80)
    assert spec.logprobs == plain.logprobs
    assert spec.text.lstrip().startswith("{")
    assert_accepted(spec)


def test_greedy_with_a_schema_while_others_run(runner):
    if runner.model.backend.repacked_weights():  # the other request's rows may share the prompt's batch
        pytest.skip("repacked weights: a prompt batched with another sequence's rows differs from solo without "
                    "speculation too (the README's Numerics); alone and with a grammar are tested")
    schema = format_grammar({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
    plain = Run(runner, JSON_PROMPT, False, schema, num_predict=80)
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(Run, runner, OTHERS[2], True, num_predict=40)
        spec = Run(runner, JSON_PROMPT, True, schema, num_predict=80)
        other.result()
    assert spec.logprobs == plain.logprobs
    assert_accepted(spec)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_draws_the_same_tokens(runner, seed):
    """With a point-mass draft, rejection sampling is: draw as usual, keep the draft iff it was drawn. One draw
    per generated token, in order, so a seeded request gives plain decoding's tokens: the output distribution is
    the target's (a stronger check than a statistical one)."""
    def sampled(spec: bool) -> Run:
        return Run(runner, COPY, spec, sampler=Sampler(temperature=0.7, top_k=40, top_p=0.95, seed=seed),
                   num_predict=50)
    plain, spec = sampled(False), sampled(True)
    assert spec.logprobs == plain.logprobs
    assert_accepted(spec)


def test_verify_batches_stay_within_the_batch_size(gemma3_path):
    """A batch of 8 (num_batch): verify batches of at most 8 rows, as the memory plan and Gemma's sliding-window
    ring (the window and one batch) were sized for, and still plain decoding's logprobs."""
    runner, loaded = open_runner(gemma3_path, batch_size=8, flash=False)
    try:
        assert runner.spec_rows == 8
        plain = Run(runner, COPY, False, num_predict=40)
        spec = Run(runner, COPY, True, num_predict=40, draft_num_predict=MAX_DRAFT)
    finally:
        runner.close()
        loaded.close()
    assert spec.logprobs == plain.logprobs
    assert_accepted(spec)


def test_through_a_context_shift(model):
    """A 96-token context: the copy overflows it, the slot shifts (the drafts never cause a shift of their own)."""
    runs = []
    for speculating in (False, True):  # each on a fresh runner: both cold, nothing from the other's cache
        runner, loaded = open_runner(model, parallel=1, kv_size=96)
        try:
            runs.append(Run(runner, COPY, speculating, num_predict=150))
        finally:
            runner.close()
            loaded.close()
    plain, spec = runs
    assert plain.seq.num_prompt_inputs + len(plain.entries) > 96  # the context shifted
    assert spec.logprobs == plain.logprobs
    assert_accepted(spec)
