"""Repeat, frequency and presence penalties: checked against llama.cpp's own penalties sampler on the same logits
and token history, and end to end through serve on real SmolLM2 weights against llama.cpp decoding the same
prompt with the same penalties (the prompt's tokens in the window, as llama-server does)."""

from __future__ import annotations

import ctypes
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from serve_process import serve_process

from ollama_engine.api.native import SAMPLING_DEFAULTS, ApiError, split_options
from ollama_engine.sample import Sampler
from ollama_engine.sample.penalties import INT32_MAX, Penalties, PenaltySettings
from ollama_engine.server.wire import CompletionRequest, WireError

VOCAB = 300

# (last_n, repeat, frequency, presence): each alone, together, a window shorter than the history, a penalty
# below 1 (rewards repeats) and negative frequency/presence, as llama.cpp allows.
SETTINGS = [(64, 1.3, 0.0, 0.0), (64, 1.0, 0.5, 0.0), (64, 1.0, 0.0, 0.7), (8, 1.7, 0.31, 0.9),
            (3, 1.1, 0.2, 0.05), (16, 0.8, -0.4, -0.25), (1, 2.5, 1.0, 1.0)]


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("kwargs", [
    {"repeat": math.nan}, {"repeat": math.inf}, {"repeat": 0}, {"repeat": -1.1}, {"repeat": 1e39},
    {"repeat": 1e-45},  # 1/x overflows float32, llama.cpp's test
    {"frequency": math.nan}, {"frequency": 1e39}, {"presence": -math.inf}, {"presence": "1"},
    {"last_n": -2}, {"last_n": INT32_MAX + 1}, {"last_n": 1.5}, {"last_n": True}, {"repeat": True},
])
def test_invalid_settings_say_why(kwargs: dict[str, Any]):
    with pytest.raises(TypeError) as caught:
        PenaltySettings(**kwargs)
    name = {"repeat": "repeat_penalty", "frequency": "frequency_penalty", "presence": "presence_penalty",
            "last_n": "repeat_last_n"}[next(iter(kwargs))]
    assert name in str(caught.value)


def test_ollamas_defaults_leave_greedy_output_alone():
    """Ollama's api.DefaultOptions() at HEAD has repeat_penalty 1.0 (1.1 in the Go engine's days, which ignored
    it): the defaults switch nothing on, so a user's greedy output does not change."""
    assert PenaltySettings.from_options(SAMPLING_DEFAULTS).off
    assert Sampler.from_options(None).penalties.settings.off
    assert PenaltySettings.from_options({"repeat_penalty": 1.3, "repeat_last_n": 0}).off


def test_runner_reads_absent_keys_as_zero_and_a_zero_repeat_penalty_as_off():
    """The parent leaves zero values out (Go's omitempty): no window means off, and repeat_penalty 0 (invalid
    to llama.cpp) can only have come from an omitted key."""
    assert PenaltySettings.from_options({}, absent_is_zero=True).off
    settings = PenaltySettings.from_options({"repeat_last_n": 64, "presence_penalty": 0.5}, absent_is_zero=True)
    assert (settings.last_n, settings.repeat, settings.presence) == (64, 1.0, 0.5)
    assert PenaltySettings.from_options({"repeat_last_n": 64, "repeat_penalty": 0}, absent_is_zero=True).repeat == 1


@pytest.mark.parametrize("options", [{"repeat_penalty": -1}, {"repeat_last_n": -5}, {"frequency_penalty": 1e39},
                                     {"presence_penalty": "a lot"}, {"repeat_last_n": 2**40}])
def test_the_runner_answers_a_bad_penalty_with_a_400(options: dict[str, Any]):
    body = json.dumps({"prompt": "x", "options": {"temperature": 0, **options}}).encode()
    with pytest.raises(WireError):
        CompletionRequest.from_json(body)


@pytest.mark.parametrize("options", [{"repeat_penalty": -1}, {"repeat_penalty": 0}, {"repeat_last_n": -2},
                                     {"repeat_last_n": 2**31}, {"frequency_penalty": 1e39},
                                     {"presence_penalty": -3.5e38}])
def test_the_api_answers_a_bad_penalty_with_a_400_before_loading(options: dict[str, Any]):
    with pytest.raises(ApiError) as caught:
        split_options(options)
    assert caught.value.status == 400 and next(iter(options)) in str(caught.value)


def test_a_window_of_minus_one_is_the_context():
    penalties = Penalties(PenaltySettings(last_n=-1, repeat=2.0), history=range(10), num_ctx=4)
    out = penalties.apply(np.ones(12, dtype=np.float32))
    np.testing.assert_array_equal(out, [1] * 6 + [0.5] * 4 + [1, 1])


# ---------------------------------------------------------------- against llama.cpp's sampler


class LlamaPenalties:
    """llama.cpp's llama_sampler_init_penalties over a vocabulary of VOCAB ids."""

    def __init__(self, settings: PenaltySettings, num_ctx: int = 0) -> None:
        import llama_cpp

        self.lib = llama_cpp
        last_n = settings.last_n if settings.last_n >= 0 else num_ctx
        self.sampler = llama_cpp.llama_sampler_init_penalties(VOCAB, last_n, settings.repeat, settings.frequency,
                                                              settings.presence)
        self.data = (llama_cpp.llama_token_data * VOCAB)()

    def accept(self, token: int) -> None:
        self.lib.llama_sampler_accept(self.sampler, token)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        rows = np.ctypeslib.as_array(self.data)
        rows["id"] = np.arange(VOCAB)
        rows["logit"] = logits
        rows["p"] = 0
        array = self.lib.llama_token_data_array(self.data, VOCAB, -1, False)
        self.lib.llama_sampler_apply(self.sampler, ctypes.byref(array))
        out = np.empty(VOCAB, dtype=np.float32)
        out[rows["id"]] = rows["logit"]
        return out

    def close(self) -> None:
        self.lib.llama_sampler_free(self.sampler)


@pytest.mark.reference
@pytest.mark.parametrize("setting", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_penalised_logits_equal_llama_cpps_bitwise(setting: tuple[int, float, float, float]):
    """Along 60 steps of a history that starts with a 40-token prompt, repeats itself and slides out of the
    window, our logits equal llama.cpp's bit for bit (positive, negative, zero and -inf logits)."""
    settings = PenaltySettings(*setting)
    rng = np.random.default_rng(setting[0])
    prompt = rng.integers(0, 40, size=40).tolist()  # a small alphabet: many repeats
    ours = Penalties(settings, history=prompt)
    theirs = LlamaPenalties(settings)
    try:
        for token in prompt:
            theirs.accept(token)
        for _ in range(60):
            logits = rng.normal(0, 4, VOCAB).astype(np.float32)
            logits[rng.integers(0, VOCAB, 5)] = 0.0
            logits[rng.integers(0, VOCAB, 2)] = -np.inf
            expected = theirs.apply(logits)
            np.testing.assert_array_equal(ours.apply(logits), expected)
            token = int(rng.integers(0, 50))
            ours.accept(token)
            theirs.accept(token)
    finally:
        theirs.close()


@pytest.mark.reference
def test_greedy_chain_with_logit_bias_equals_llama_cpps():
    """llama.cpp's chain order: logit_bias, then penalties, then the choice (greedy here)."""
    import llama_cpp

    settings = PenaltySettings(last_n=6, repeat=1.4, frequency=0.3, presence=0.2)
    bias = {7: 2.5, 11: -1.0, 3: 1.5}
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    entries = (llama_cpp.llama_logit_bias * len(bias))(*[llama_cpp.llama_logit_bias(t, b) for t, b in bias.items()])
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_logit_bias(VOCAB, len(bias), entries))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_penalties(VOCAB, 6, 1.4, 0.3, 0.2))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    sampler = Sampler(temperature=0, logit_bias={str(t): b for t, b in bias.items()}, penalties=settings)
    prompt = [7, 3, 7]
    sampler.start(prompt, num_ctx=64)
    data = (llama_cpp.llama_token_data * VOCAB)()
    rows = np.ctypeslib.as_array(data)
    rng = np.random.default_rng(5)
    try:
        for token in prompt:
            llama_cpp.llama_sampler_accept(chain, token)
        chosen = []
        for _ in range(40):
            # a flat distribution around a few strong tokens: without the penalties greedy repeats them
            logits = rng.normal(0, 0.05, VOCAB).astype(np.float32)
            logits[[7, 3, 11, 20, 21]] += np.float32([3.0, 2.9, 3.4, 2.0, 1.9])
            rows["id"], rows["logit"], rows["p"] = np.arange(VOCAB), logits, 0
            array = llama_cpp.llama_token_data_array(data, VOCAB, -1, False)
            llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
            expected = int(rows["id"][array.selected])
            token = sampler.sample(logits)
            assert token == expected
            llama_cpp.llama_sampler_accept(chain, token)
            sampler.accept(token)
            chosen.append(token)
        assert len(set(chosen)) >= 3, "without the penalties greedy picks 7 (biased to 5.5) every time"
    finally:
        llama_cpp.llama_sampler_free(chain)


def test_a_subset_of_rows_is_penalised_as_the_whole_vocabulary():
    """A grammar's second draw samples only the allowed ids' logits: the same penalties reach them."""
    rng = np.random.default_rng(1)
    penalties = Penalties(PenaltySettings(last_n=10, repeat=1.5, frequency=0.25, presence=0.5),
                          history=rng.integers(0, 30, 20).tolist())
    logits = rng.normal(0, 3, 40).astype(np.float32)
    ids = np.sort(rng.choice(40, 15, replace=False))
    np.testing.assert_array_equal(penalties.apply(logits[ids], ids), penalties.apply(logits)[ids])
    assert penalties.apply(logits[:0], ids[:0]).size == 0


def test_apply_leaves_the_logits_alone():
    logits = np.arange(8, dtype=np.float32) - 4
    penalties = Penalties(PenaltySettings(last_n=4, repeat=2.0, frequency=1.0), history=[1, 2, 2, 6])
    out = penalties.apply(logits)
    np.testing.assert_array_equal(logits, np.arange(8, dtype=np.float32) - 4)
    np.testing.assert_array_equal(out, [-4, -6 - 1, -4 - 2, -1, 0, 1, 1 - 1, 3])


# ---------------------------------------------------------------- through serve on SmolLM2

PROMPT = "Repeat after me: one, two, one, two, one, two, one, two, one, two,"
PENALTIES = {"repeat_penalty": 1.5, "repeat_last_n": 32, "frequency_penalty": 0.4, "presence_penalty": 0.3}
N = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path) -> Iterator[str]:
    import ollama

    root = tmp_path_factory.mktemp("penalties")
    with serve_process(root / "models") as url:
        client = ollama.Client(host=url)
        client.create(model="smollm2", files={"smollm2.gguf": client.create_blob(smollm2_path)})
        yield url


def generate(server: str, options: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "smollm2", "prompt": PROMPT, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": N, **options}}
    response = httpx.post(server + "/api/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def llama_cpp_generate(path: Path, penalties: dict[str, Any]) -> tuple[str, int]:
    """llama.cpp decoding PROMPT greedily with its penalties sampler, every prompt token accepted first (what
    llama-server's init_sampler does); (text, prompt tokens)."""
    import llama_cpp

    from ollama_engine.ml.device import default_threads

    threads = default_threads()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, verbose=False)  # serve's default on the CPU
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_penalties(
        llm.n_vocab(), penalties["repeat_last_n"], penalties["repeat_penalty"], penalties["frequency_penalty"],
        penalties["presence_penalty"]))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    try:
        tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
        for token in tokens:
            llama_cpp.llama_sampler_accept(chain, token)
        llm.eval(tokens)
        out: list[int] = []
        for _ in range(N):
            token = llama_cpp.llama_sampler_sample(chain, llm.ctx, -1)  # applies, picks, accepts
            if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token):
                break
            out.append(token)
            llm.eval([token])
        return llm.detokenize(out).decode("utf-8", errors="replace"), len(tokens)
    finally:
        llama_cpp.llama_sampler_free(chain)
        llm.close()


@pytest.mark.reference
def test_penalised_greedy_generation_equals_llama_cpps(server: str, smollm2_path: Path):
    plain = generate(server, {})
    penalised = generate(server, PENALTIES)
    assert penalised["response"] != plain["response"], "the penalties changed what greedy decoding picks"
    expected, prompt_tokens = llama_cpp_generate(smollm2_path, PENALTIES)
    assert penalised["prompt_eval_count"] == prompt_tokens
    assert penalised["response"] == expected


def test_default_options_are_plain_greedy_decoding(server: str):
    """No penalty option: the same tokens as with the penalties explicitly off."""
    off = {"repeat_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0}
    assert generate(server, {})["response"] == generate(server, off)["response"]


def test_openai_presence_and_frequency_penalties_reach_the_sampler(server: str):
    """OpenAI's two penalties on /v1/chat/completions give what the native options give on /api/chat (Ollama's
    window of 64 tokens, repeat_penalty off)."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say 'la' twenty times."}]
    answer = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=N,
                                            presence_penalty=1.5, frequency_penalty=1.0)
    plain = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=N)
    native = httpx.post(server + "/api/chat", timeout=300, json={
        "model": "smollm2", "messages": messages, "stream": False,
        "options": {"temperature": 0, "top_p": 1.0, "num_predict": N, "presence_penalty": 1.5,
                    "frequency_penalty": 1.0}}).json()
    assert answer.choices[0].message.content == native["message"]["content"]
    assert answer.choices[0].message.content != plain.choices[0].message.content


@pytest.mark.parametrize("options", [{"repeat_penalty": -1}, {"repeat_last_n": -7}, {"repeat_last_n": 2**31},
                                     {"presence_penalty": 1e39}])
def test_bad_penalties_are_a_400_through_serve(server: str, options: dict[str, Any]):
    body = {"model": "smollm2", "prompt": "hi", "stream": False, "options": {"num_predict": 1, **options}}
    response = httpx.post(server + "/api/generate", json=body, timeout=120)
    assert response.status_code == 400 and next(iter(options)) in response.json()["error"]


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": "high"}),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}),
])
def test_openai_penalties_outside_openais_range_are_a_400(server: str, route: str, body: dict[str, Any]):
    response = httpx.post(server + route, json={"model": "smollm2", "max_tokens": 1, **body}, timeout=120)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "between -2 and 2" in error["message"]


# ---------------------------------------------------------------- with n-gram speculation


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "sampled"])
def test_speculation_keeps_penalised_decoding_exact(smollm2_path: Path, seed: int | None):
    """Drafts are verified row by row, each row sampled after the tokens before it joined the window: the same
    tokens as plain decoding with the same penalties."""
    from test_speculative import COPY, Run, assert_accepted, open_runner

    def sampler() -> Sampler:
        settings = PenaltySettings(last_n=16, repeat=1.1, frequency=0.05)
        if seed is None:
            return Sampler(temperature=0, penalties=settings)
        return Sampler(temperature=0.7, top_k=40, top_p=0.95, seed=seed, penalties=settings)

    runner, loaded = open_runner(smollm2_path)
    try:
        plain = Run(runner, COPY, False, sampler=sampler(), num_predict=40)
        spec = Run(runner, COPY, True, sampler=sampler(), num_predict=40)
        unpenalised = Run(runner, COPY, False, num_predict=40) if seed is None else None
    finally:
        runner.close()
        loaded.close()
    assert spec.logprobs == plain.logprobs
    assert_accepted(spec)
    if unpenalised is not None:
        assert plain.text != unpenalised.text, "the penalties changed the greedy text"
