"""Structured outputs through the batch loop, the runner's HTTP API and `serve` (issue 15).

The batch loop runs a synthetic llama (random weights, the SentencePiece vocabulary) sampled at temperature
1: constrained and unconstrained sequences share batches, and each gives what it gives alone. The HTTP
tests run the runner subprocess and `serve` with the real SmolLM2 (byte-level BPE).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from serve_process import serve_process
from synthetic.models import write_synthetic
from test_grammar import SCHEMA, check_schema
from test_runner_e2e import Client, completion, free_port, start_runner

from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import DoneReason, SequenceOptions
from ollama_engine.sample import GrammarError, Sampler, format_grammar
from ollama_engine.sample.grammar_text import GRAMMAR_JSON

PARALLEL = 4
WORDS = 'root ::= "(" [a-z]{1,6} ("," " "? [a-z]{1,6}){0,3} ")"'  # always ends by itself
WORDS_RE = r"\([a-z]{1,6}(?:, ?[a-z]{1,6}){0,3}\)"


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    # quantized weights: F32 matmuls round differently in batches of other widths (Q8_0's integer dot
    # products do not), and at temperature 1 a last-bit difference can change a draw
    path = write_synthetic(tmp_path_factory.mktemp("grammar") / "llama.gguf", "llama", weight_type="Q8_0")
    # one thread: a busy machine (CI) slows spinning thread pools far more than it slows one thread
    params = LoadParams(parallel=PARALLEL, batch_size=16, kv_size=512 * PARALLEL, num_threads=1)
    loaded = open_model(str(path), params, allocate=True)
    loaded.model.backend.load()
    errors: list[BaseException] = []
    runner = Runner(loaded, errors.append)
    runner.start()
    yield runner
    runner.close()
    loaded.close()
    assert not errors


def run(runner: Runner, prompt: str, seed: int, grammar: str = "", **options: Any) -> tuple[str, DoneReason, Any]:
    """One completion through the batch loop: its text, why it ended, and the sequence (with `cached`: how
    many prompt inputs the prompt cache supplied)."""
    done, pieces = threading.Event(), []

    def sink(piece) -> None:
        if piece is None:
            done.set()
        else:
            pieces.append(piece.text)

    options = SequenceOptions(sampler=Sampler(temperature=1.0, top_k=0, top_p=1.0, seed=seed),
                              **{"num_predict": 400, **options})
    seq = runner.new_sequence(prompt, options, grammar)
    with runner.cond:  # re-entrant: the batch loop cannot take the inputs before they are counted
        runner.add(seq, sink)
        seq.cached = seq.num_prompt_inputs - len(seq.inputs)
    assert done.wait(300), "the completion did not finish"
    assert seq.error is None, seq.error
    return "".join(pieces), seq.done_reason, seq


REQUESTS = [  # (prompt, seed, grammar, num_predict): prompts of several lengths, some longer than a batch
    ("Describe a person as JSON:", 1, format_grammar(SCHEMA), 400),
    ("Once upon a time there was a little cat who liked to play in the garden with the dog", 2, "", 24),
    ("A list of words:", 3, WORDS, 400),
    ("Any JSON object, please, with whatever keys and values you like best", 4, GRAMMAR_JSON, 40),
    ("Another person:", 5, format_grammar(SCHEMA), 400),
    ("Hello", 6, "", 24),
]


def check(grammar: str, text: str, reason: DoneReason) -> None:
    if grammar == WORDS:
        assert reason == DoneReason.STOP and re.fullmatch(WORDS_RE, text), text
    elif grammar == GRAMMAR_JSON:  # any object: strings are unbounded, so it may end by length
        assert text.startswith("{") and (reason == DoneReason.LENGTH or isinstance(json.loads(text), dict)), text
    elif grammar:
        assert reason == DoneReason.STOP, text
        check_schema(json.loads(text), SCHEMA)


def test_constrained_and_unconstrained_sequences_share_batches(runner):
    """Alone, then six at a time on four slots: every sequence gives the same text, the constrained ones valid."""

    def one(request: tuple[str, int, str, int]) -> tuple[str, DoneReason]:
        prompt, seed, grammar, num_predict = request
        return run(runner, prompt, seed, grammar, num_predict=num_predict)[:2]

    alone = [one(request) for request in REQUESTS]
    with ThreadPoolExecutor(PARALLEL) as pool:  # a slot frees before its sequence's sink hears the end
        together = list(pool.map(one, REQUESTS))
    assert together == alone
    for (_, _, grammar, _), (text, reason) in zip(REQUESTS, alone, strict=True):
        check(grammar, text, reason)


def test_an_unfinished_document_ends_by_length_or_stop_not_an_error(runner):
    grammar = format_grammar(SCHEMA)
    text, reason, seq = run(runner, "Describe a person as JSON:", 7, grammar, num_predict=5)
    assert reason == DoneReason.LENGTH and seq.num_predicted == 5 and text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    text, reason, _ = run(runner, "Describe a person as JSON:", 7, grammar, stop=['"'])
    assert reason == DoneReason.STOP and text.startswith("{") and '"' not in text and text.strip() == "{"


def test_prompt_cache_reuse_keeps_the_grammar_fresh(runner):
    """The second request reuses the cached prompt; its matcher starts at the grammar's beginning again."""
    prompt = "A person described as JSON, with a name and an age and an address:"
    first = run(runner, prompt, 8, format_grammar(SCHEMA))
    second = run(runner, prompt, 8, format_grammar(SCHEMA))
    assert second[:2] == first[:2]
    check(format_grammar(SCHEMA), *first[:2])
    assert second[2].cached == second[2].num_prompt_inputs - 1  # all but the last input, re-evaluated for logits


def test_invalid_grammar_is_refused_before_the_sequence_starts(runner):
    with pytest.raises(GrammarError, match="invalid grammar"):
        runner.new_sequence("x", SequenceOptions(sampler=Sampler()), "root ::= missing")


# ---------------------------------------------------------------- the runner's HTTP API (Ollama's parent)


@pytest.fixture(scope="module")
def runner_client(smollm2_path: Path):
    port = free_port()
    proc = start_runner(smollm2_path, port)
    client = Client(port)
    try:
        for operation in (0, 1, 2):
            client.load(operation, NumThreads=1)  # see the batch-loop fixture
        while client.json("GET", "/health")["status"] != 0:
            pass
        yield client
    finally:
        proc.kill()


PROMPT = "<|im_start|>user\nGive me a JSON object about a cat.<|im_end|>\n<|im_start|>assistant\n"


def test_runner_grammar_field(runner_client):
    """Ollama's parent sends GBNF in the Grammar field: its own JSON grammar, or any other."""
    text, final = runner_client.complete(PROMPT, options={"num_predict": 40, "temperature": 0}, Grammar=GRAMMAR_JSON)
    assert text.startswith("{") and final["eval_count"] <= 40, text
    if final["done_reason"] == 0:  # greedy SmolLM2 may repeat a value until the length limit
        assert isinstance(json.loads(text), dict), text
    text, final = runner_client.complete(PROMPT, options={"num_predict": 50, "temperature": 1, "seed": 3},
                                         Grammar=WORDS)
    assert final["done_reason"] == 0 and re.fullmatch(WORDS_RE, text), text
    status, body = runner_client.request("POST", "/completion", completion(PROMPT, Grammar="root ::= nowhere"))
    assert status == 400 and body.startswith(b"invalid grammar: ") and b"nowhere" in body


# ---------------------------------------------------------------- serve: format and response_format


SERVE_LOGS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path):
    import ollama

    root = tmp_path_factory.mktemp("grammar-api")
    with serve_process(root / "models") as url:
        SERVE_LOGS[url] = root / f"serve-{url.rsplit(':', 1)[1]}.log"  # where serve_process writes it
        client = ollama.Client(host=url)
        client.create(model="smollm2", files={"smollm2.gguf": client.create_blob(smollm2_path)},
                      parameters={"num_thread": 1})  # see the batch-loop fixture
        yield url


CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 30},
                                        "colors": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                   "maxItems": 3}},
       "required": ["name", "age", "colors"]}


def test_format_on_chat_and_generate(server):
    import ollama

    client = ollama.Client(host=server)
    messages = [{"role": "user", "content": "Describe a cat as JSON."}]
    reply = client.chat(model="smollm2", messages=messages, format=CAT, options={"temperature": 0, "num_predict": 200})
    assert reply.done_reason == "stop"
    check_schema(json.loads(reply.message.content), CAT)
    reply = client.generate(model="smollm2", prompt="A JSON object about a cat:", format="json",
                            options={"temperature": 1, "seed": 1, "num_predict": 10})
    assert reply.response.startswith("{") and reply.done_reason in ("stop", "length")
    # the ollama client refuses such formats itself: sent as raw HTTP
    for bad, message in [("yaml", 'invalid format: "\\"yaml\\""; expected "json" or a valid JSON Schema object'),
                         ({"type": "frobnicate"}, "invalid JSON schema in format: ")]:
        for route, body in [("/api/chat", {"messages": messages}), ("/api/generate", {"prompt": "x"})]:
            request = urllib.request.Request(server + route, method="POST",
                                             data=json.dumps({"model": "smollm2", "format": bad, **body}).encode())
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=60)
            assert err.value.code == 400 and json.loads(err.value.read())["error"].startswith(message)


def test_openai_response_format(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Describe a cat as JSON."}]
    out = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}})
    check_schema(json.loads(out.choices[0].message.content), CAT)
    out = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=20,
                                         response_format={"type": "json_object"})
    [choice] = out.choices
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":  # an object the model closed; else cut by max_tokens
        assert isinstance(json.loads(choice.message.content), dict)


# A schema keyword llguidance enforces (`pattern`) beside one it does not (`uniqueItems`).
CODE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                         "ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99},
                                                 "uniqueItems": True, "maxItems": 3}},
        "required": ["code", "ids"]}


def test_pattern_enforced_through_ollama_and_openai_clients_and_unsupported_keywords_logged(server):
    """Real SmolLM2 at temperature 1: every answer's `code` matches the pattern (the model alone would not
    write one); `uniqueItems`, which llguidance does not enforce, is named in serve's log."""
    import ollama

    openai = pytest.importorskip("openai")
    messages = [{"role": "user", "content": "Give me a product code as JSON."}]
    native = ollama.Client(host=server)
    answers = [native.chat(model="smollm2", messages=messages, format=CODE,
                           options={"temperature": 1, "seed": seed, "num_predict": 80}).message.content
               for seed in range(6)]
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    for seed in range(3):
        out = client.chat.completions.create(
            model="smollm2", messages=messages, temperature=1, seed=seed, max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "code", "schema": CODE}})
        answers.append(out.choices[0].message.content)
    for text in answers:
        value = json.loads(text)
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", value["code"]), text
        assert isinstance(value["ids"], list) and len(value["ids"]) <= 3, text
    log = SERVE_LOGS[server].read_text(errors="replace")
    assert "not enforced" in log and "uniqueItems" in log
