"""Speculative decoding with a draft model gives exactly the tokens and logprobs of plain decoding, on real weights.

The target is the real SmolLM2-135M-Instruct (Q4_1). No smaller real model shares its vocabulary, so the draft is
made from it (tests/synthetic/draft.py): all 30 layers requantized to Q4_0 with ggml's quantizers. It agrees
with the target on most tokens but not all, so drafts are kept and rejected (and both caches rolled back).
Each case compares a runner loaded with the draft against one without it: every token and logprob (and the top
alternatives) equal, not close, and drafts accepted, so that a speculation that never happens cannot pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from synthetic.draft import write_draft
from test_speculative import COPY, JSON_PROMPT, OTHERS, CheapRows, Run

from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.draft import DraftModel, VocabularyMismatch, sure_greedy
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.speculate import Speculator, StepCost
from ollama_engine.sample import Sampler
from ollama_engine.sample.grammar_text import GRAMMAR_JSON

TEXT_TO_COPY = COPY.split("exactly:\n")[1].split("<|im_end|>")[0]
CHAT = "<|im_start|>user\nTell me a short story about a cat who learns to swim.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def draft_path(smollm2_path: Path, tmp_path_factory) -> Path:
    return write_draft(smollm2_path, tmp_path_factory.mktemp("draft") / "smollm2-q4_0.gguf", layers=30,
                       quantize="Q4_0")


def params(draft: Path | None, parallel: int = 2, kv_size: int = 2048) -> LoadParams:
    return LoadParams(parallel=parallel, batch_size=64, kv_size=kv_size, num_threads=2, flash_attention=1,
                      draft_path=str(draft or ""))


class FixedDraftCost:
    """The draft model's step cost fixed at a tenth of a decode step (CheapRows' 1.0 s), whatever the machine's
    load: exactness is what these tests check, so they must speculate wherever the draft is sure."""

    @staticmethod
    def apply(draft: DraftModel) -> None:
        draft.step_seconds = 0.1
        draft.record_step = lambda seconds: None


def open_runner(path: Path, draft: Path | None, parallel: int = 2, kv_size: int = 2048) -> tuple[Runner, Any]:
    loaded = open_model(str(path), params(draft, parallel, kv_size), allocate=True)
    loaded.load()
    if draft is not None:
        assert loaded.draft is not None
        FixedDraftCost.apply(loaded.draft)
    runner = Runner(loaded, lambda err: pytest.fail(f"runner failed: {err}"))
    runner.step_cost = CheapRows()
    runner.start()
    return runner, loaded


@pytest.fixture(scope="module")
def plain(smollm2_path):
    runner, loaded = open_runner(smollm2_path, None)
    yield runner
    runner.close()
    loaded.close()


@pytest.fixture(scope="module")
def drafted(smollm2_path, draft_path):
    runner, loaded = open_runner(smollm2_path, draft_path)
    yield runner
    runner.close()
    loaded.close()


def assert_drafted(*runs: Run) -> None:
    specs = [run.seq.spec for run in runs]
    assert all(s is not None and s.drafter.__class__.__name__ == "ModelDrafter" for s in specs)
    assert sum(s.accepted for s in specs) > 0, "no draft was accepted: speculation did not happen"


# ---------------------------------------------------------------- units


class _FixedDrafter:
    """A drafter whose tokens cost what the test says (the controller reads only its cost here)."""

    def __init__(self, seconds: float) -> None:
        self.seconds_per_token = seconds

    def bind(self, slot: int) -> None: ...
    def append(self, token: int) -> None: ...
    def ready(self, limit: int) -> bool: return True
    def draft(self, limit: int) -> list[int]: return [1] * limit


def test_the_draft_models_cost_is_paid_per_drafted_token():
    cost = StepCost()
    for rows in range(1, 8):  # each extra verify row a fifth of a step
        cost.record(rows, 1.0 + 0.2 * (rows - 1))
    free, dear = Speculator(_FixedDrafter(0.0), 6), Speculator(_FixedDrafter(1.0), 6)
    for spec in (free, dear):
        for _ in range(5):
            spec.record(6, 6)  # every draft kept
    assert free.worth(6, cost) == 6  # a lookup: as many as allowed
    assert dear.worth(6, cost) == 0  # a draft step as dear as a decode step never pays, even when always right


def test_drafting_stops_where_the_draft_is_unsure():
    assert sure_greedy(np.array([0.0, 10.0, 0.0], dtype=np.float32)) == (1, True)
    assert sure_greedy(np.zeros(4, dtype=np.float32)) == (0, False)  # a quarter each: below P_MIN
    assert sure_greedy(np.array([0.0, -np.inf, np.inf], dtype=np.float32))[1] is False


# ---------------------------------------------------------------- loading


def test_a_draft_with_another_vocabulary_is_refused(smollm2_path, gemma3_path):
    with pytest.raises(VocabularyMismatch, match="draft model"):
        open_model(str(smollm2_path), params(gemma3_path), allocate=False)


def test_fit_counts_the_draft_and_equals_alloc(smollm2_path, draft_path):
    """The draft's weights, cache and graph are in the report (with the output layer, on the CPU); fit == alloc."""
    def report(draft: Path | None, allocate: bool):
        loaded = open_model(str(smollm2_path), params(draft), allocate=allocate)
        try:
            return loaded.memory
        finally:
            loaded.close()

    without, fit, alloc = report(None, False), report(draft_path, False), report(draft_path, True)
    assert fit == alloc
    weights = fit.cpu.weights[-1] - without.cpu.weights[-1]
    assert weights >= 0.9 * draft_path.stat().st_size  # the draft's whole file, but for metadata
    assert fit.cpu.cache[-1] > without.cpu.cache[-1]  # its KV cache: same slots and context as the model's
    assert fit.cpu.graph > without.cpu.graph
    assert fit.cpu.weights[:-1] == without.cpu.weights[:-1] and fit.cpu.cache[:-1] == without.cpu.cache[:-1]


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("prompt", [COPY, CHAT], ids=["copy", "chat"])
def test_greedy_alone(plain, drafted, prompt):
    a = Run(plain, prompt, False, num_predict=60)
    b = Run(drafted, prompt, False, num_predict=60)
    assert b.logprobs == a.logprobs
    assert b.seq.done_reason == a.seq.done_reason
    assert_drafted(b)


def test_rejected_drafts_roll_back_both_caches(plain, drafted):
    """Some drafts are rejected (the Q4_0 draft differs from the Q4_1 target), and decoding stays exact after:
    the target's cells and the draft model's own past the first rejection were removed."""
    runs = [(Run(plain, p, False, num_predict=60), Run(drafted, p, False, num_predict=60)) for p in (CHAT, OTHERS[1])]
    for a, b in runs:
        assert b.logprobs == a.logprobs
    assert sum(b.seq.spec.drafted - b.seq.spec.accepted for _, b in runs) > 0, "no draft was rejected"
    draft = drafted.loaded.draft
    held = draft._held[runs[-1][1].seq.slot.id]
    history = runs[-1][1].seq.spec.drafter.tokens
    assert held[:len(held) - 8] == history[:len(held) - 8]  # what the draft cache holds is the sequence's text


def test_greedy_batched_two_speculating(plain, drafted, monkeypatch):
    """Two sequences at once, each drafting and verifying in the same batches, against each alone without drafts.
    The draft model drafts for both in one batch of its own (a row per sequence), not one sequence after the other."""
    draft = drafted.loaded.draft
    widths: list[int] = []  # sequences per batch of the draft model
    compute = draft._compute
    monkeypatch.setattr(draft, "_compute", lambda rows: widths.append(len(rows)) or compute(rows))
    prompts = [COPY, CHAT]
    alone = [Run(plain, p, False, num_predict=40) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: Run(drafted, p, False, num_predict=40), prompts))
    for a, b in zip(alone, together, strict=True):
        assert b.logprobs == a.logprobs
    assert_drafted(*together)
    assert all(b.seq.spec.drafted for b in together), "each sequence speculates"
    assert max(widths) == 2 and widths.count(2) >= 5, widths


def test_draft_many_batches_every_sequence(drafted):
    """Two slots with the same history draft in shared batches: the same drafts for both (their rows are computed
    alike in one batch), each cache then holding the history and the drafts but the last."""
    draft = drafted.loaded.draft
    history = drafted.tokenizer.encode(CHAT, add_special=True)
    calls: list[list[tuple[int, list[int]]]] = []
    compute = draft._compute
    draft._compute = lambda rows: calls.append(rows) or compute(rows)
    try:
        first, second = draft.draft_many([(0, history, 5), (1, history, 5)])
    finally:
        del draft._compute
    assert first == second and len(first) >= 1
    assert all(len(rows) == 2 for rows in calls)  # the catch-up and every step: both sequences in one batch
    for slot in (0, 1):
        assert draft._held[slot] == history + first[:-1]


def test_greedy_with_a_json_grammar(plain, drafted):
    a = Run(plain, JSON_PROMPT, False, GRAMMAR_JSON, num_predict=80)
    b = Run(drafted, JSON_PROMPT, False, GRAMMAR_JSON, num_predict=80)
    assert b.logprobs == a.logprobs
    assert b.text.lstrip().startswith("{")
    assert_drafted(b)


@pytest.mark.parametrize("seed", [1, 2])
def test_sampled_draws_the_same_tokens(plain, drafted, seed):
    """A greedy draft is a point mass: rejection sampling keeps a draft iff the sampler draws it, one draw per
    generated token, so a seeded request gives plain decoding's tokens (runner/speculate.py)."""
    def sampled(runner: Runner) -> Run:
        return Run(runner, CHAT, False, sampler=Sampler(temperature=0.7, top_k=40, top_p=0.95, seed=seed),
                   num_predict=50)
    a, b = sampled(plain), sampled(drafted)
    assert b.logprobs == a.logprobs
    assert_drafted(b)


def test_through_a_context_shift(smollm2_path, draft_path):
    """A 96-token context: the copy overflows it and the slot shifts. Speculation stops at the shift, as the n-gram
    path does (runner/speculate.Speculator.stopped); tokens and logprobs stay plain decoding's throughout."""
    runs = []
    for draft in (None, draft_path):  # each on a fresh runner: both cold
        runner, loaded = open_runner(smollm2_path, draft, parallel=1, kv_size=96)
        try:
            runs.append(Run(runner, COPY, False, num_predict=150))
        finally:
            runner.close()
            loaded.close()
    a, b = runs
    assert a.seq.num_prompt_inputs + len(a.entries) > 96  # the context shifted
    assert b.logprobs == a.logprobs
    assert_drafted(b)
    assert b.seq.spec.stopped


def test_the_draft_model_serves_requests_one_after_another(drafted, plain):
    """A second request on a slot reuses what the draft cache holds of the first only up to their common prefix."""
    first = Run(drafted, CHAT, False, num_predict=20)
    second = Run(drafted, CHAT.replace("swim", "fly"), False, num_predict=30)
    assert second.logprobs == Run(plain, CHAT.replace("swim", "fly"), False, num_predict=30).logprobs
    assert_drafted(first, second)



# ---------------------------------------------------------------- through serve


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path, draft_path: Path):
    """serve with two models of the same weights: `smollm2` plain and `smollm2-draft` with the draft layer. The
    official client uploads the blobs; its create has no draft_files (ollama 0.6), so that request is plain HTTP."""
    import ollama
    from serve_process import serve_process

    with serve_process(tmp_path_factory.mktemp("draft-serve") / "models") as url:
        client = ollama.Client(host=url)
        files = {"smollm2.gguf": client.create_blob(smollm2_path)}
        client.create(model="smollm2", files=files)
        body = {"model": "smollm2-draft", "files": files, "stream": False,
                "draft_files": {"draft.gguf": client.create_blob(draft_path)}}
        response = httpx.post(url + "/api/create", json=body, timeout=300)
        assert response.status_code == 200, response.text
        yield url


def test_create_with_draft_files_stores_a_draft_layer(server: str):
    import ollama

    client = ollama.Client(host=server)
    shown = client.show("smollm2-draft")
    assert "\nDRAFT " in shown.modelfile and "\nDRAFT " not in client.show("smollm2").modelfile
    bad = httpx.post(server + "/api/create", json={"model": "x", "files": {"a.gguf": "sha256:" + "0" * 64},
                                                   "draft_quantize": "q4_0", "stream": False}, timeout=60)
    assert bad.status_code == 400 and "draft_quantize" in bad.text


def test_chat_through_serve_drafts_and_equals_plain(server: str):
    """The official client's chat with draft_num_predict: the same message and logprobs as the plain model; the
    final response carries draft_n / draft_n_accepted (ours, llama.cpp's names), a plain model's does not."""
    import ollama

    client = ollama.Client(host=server)
    messages = [{"role": "user", "content": "Copy this text exactly: " + TEXT_TO_COPY}]
    options = {"temperature": 0, "num_predict": 48, "draft_num_predict": 6}
    plain = client.chat(model="smollm2", messages=messages, options=options, logprobs=True)
    spec = client.chat(model="smollm2-draft", messages=messages, options=options, logprobs=True)
    assert spec.message.content == plain.message.content
    assert [(x.token, x.logprob) for x in spec.logprobs] == [(x.token, x.logprob) for x in plain.logprobs]
    raw = httpx.post(server + "/api/chat", json={"model": "smollm2-draft", "messages": messages, "options": options,
                                                  "stream": False}, timeout=300).json()
    # how much is drafted is the adaptive controller's call from measured step costs (a loaded or slower CPU
    # drafts less, or nothing): the counts are reported and consistent; the in-process tests show drafts kept
    assert 0 <= raw["draft_n_accepted"] <= raw["draft_n"], raw
    assert "draft_n" not in httpx.post(server + "/api/chat", json={"model": "smollm2", "messages": messages,
                                                                    "options": options, "stream": False},
                                       timeout=300).json()
