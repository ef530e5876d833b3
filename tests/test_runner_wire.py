"""The runner protocol's JSON and HTTP behaviour that needs no model, and prompt truncation."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from runner_client import runner_client

from ollama_engine.ml import DeviceID
from ollama_engine.ml import device as device_module
from ollama_engine.ml.device import Device
from ollama_engine.ml.memory import GIB
from ollama_engine.runner.inputs import Input
from ollama_engine.runner.sequence import DoneReason, InputTooLongError, fit_prompt
from ollama_engine.server.app import LoopInbox, RunnerServer
from ollama_engine.server.wire import (
    CompletionRequest,
    Float32,
    LoadOperation,
    LoadRequest,
    ServerStatus,
    WireError,
    _encode,
    completion_chunk,
    completion_done,
    completion_line,
    encode,
    health_response,
)

# ---------------------------------------------------------------- encoding


@pytest.mark.parametrize(("value", "expected"), [
    ({"a": 1, "b": [True, None], "c": "x"}, '{"a":1,"b":[true,null],"c":"x"}'),
    ("<a href='x'>&</a>", '"\\u003ca href=\'x\'\\u003e\\u0026\\u003c/a\\u003e"'),
    ("line\nbreak\u2028é", '"line\\nbreak\\u2028é"'),
    ("para\u2029graph", '"para\\u2029graph"'),
    (0.1, "0.1"),
    (1e-7, "1e-7"),
    (1e-6, "0.000001"),  # Go's boundary: from 1e-6 on, plain digits
    (9.999999e-7, "9.999999e-7"),
    (-1e-6, "-0.000001"),
    (Float32(1e-6), "0.000001"),
    (Float32(np.float32(1e-6)), "0.000001"),  # float32(1e-6) is just under 1e-6 in float64, not in float32
    (Float32(9.9e-7), "9.9e-7"),
    (1e20, "100000000000000000000"),
    (1e21, "1e+21"),
    (123456789.0, "123456789"),
    (Float32(1 / 3), "0.33333334"),
    (Float32(1.0), "1"),
    (-0.5, "-0.5"),
])
def test_encode_matches_go(value, expected):
    assert encode(value) == (expected + "\n").encode()


def test_encode_rejects_what_go_cannot_encode():
    with pytest.raises(ValueError):
        encode(float("-inf"))
    with pytest.raises(TypeError):
        encode(object())


def test_completion_lines():
    top = [{"token": "Hi", "logprob": -0.5}]
    chunk = completion_chunk("Hi", [{"token": "Hi", "logprob": -0.5, "top_logprobs": top}])
    assert encode(chunk) == (
        b'{"content":"Hi","done_reason":0,"done":false,"prompt_eval_count":0,"prompt_eval_duration":0,'
        b'"eval_count":0,"eval_duration":0,"logprobs":[{"token":"Hi","logprob":-0.5,'
        b'"top_logprobs":[{"token":"Hi","logprob":-0.5}]}]}\n'
    )
    assert "logprobs" not in completion_chunk("x", [])
    done = completion_done(DoneReason.LENGTH, 27, 0.041234567, 128, 1.5)
    assert encode(done) == (
        b'{"content":"","done_reason":1,"done":true,"prompt_eval_count":27,"prompt_eval_duration":41234567,'
        b'"eval_count":128,"eval_duration":1500000000}\n'
    )


def _encode_by_hand(value) -> bytes:
    out: list[str] = []
    _encode(value, out)
    return ("".join(out) + "\n").encode()


_TEXT = st.text(st.characters(codec="utf-8") | st.sampled_from("<>&\u2028\u2029\"\\\n\t\x00\x1f\x7f\b\f"))
_FLOAT_FREE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4), max_leaves=12)


@given(_FLOAT_FREE)
def test_fast_encoding_is_the_hand_written_one(value):
    """Values without floats go through json's C encoder; it must write exactly what the Go rules give."""
    assert encode(value) == _encode_by_hand(value)


@given(_TEXT)
def test_completion_line_is_the_encoded_chunk(text):
    assert completion_line(text, []) == _encode_by_hand(completion_chunk(text, []))
    logprobs = [{"token": text, "logprob": -0.25}]
    assert completion_line(text, logprobs) == _encode_by_hand(completion_chunk(text, logprobs))


def test_health_line():
    assert encode(health_response(3, 0.5029227)) == b'{"status":3,"progress":0.5029227}\n'
    # progress is a Go float32: a third has 8 digits, not float64's 16
    assert encode(health_response(3, 1 / 3)) == b'{"status":3,"progress":0.33333334}\n'


def test_enum_values_are_gos():
    """Go encodes these enums as plain integers, so the numbers are the protocol (llm/server.go, llm.LoadOperation)."""
    assert {status.name: status.value for status in ServerStatus} == {
        "READY": 0, "NO_SLOTS_AVAILABLE": 1, "LAUNCHED": 2, "LOADING_MODEL": 3, "NOT_RESPONDING": 4, "ERROR": 5}
    assert {op.name: op.value for op in LoadOperation} == {"FIT": 0, "ALLOC": 1, "COMMIT": 2, "CLOSE": 3}


# ---------------------------------------------------------------- decoding


def test_load_request_decoding():
    body = json.dumps({
        "operation": 1, "LoraPath": None, "PARALLEL": 2, "BatchSize": 512, "FlashAttention": 1, "KvSize": 4096,
        "KvCacheType": "q8_0", "NumThreads": 8, "Unknown": "ignored",
        "GPULayers": [{"id": "GPU-1", "backend": "CUDA", "Layers": [0, 1, 2]}],
    }).encode()
    req = LoadRequest.from_json(body)
    assert req.operation == LoadOperation.ALLOC and req.parallel == 2 and req.kv_cache_type == "q8_0"
    assert req.gpu_layers[0].device_id == DeviceID("GPU-1", "CUDA") and req.gpu_layers[0].layers == [0, 1, 2]
    assert req.multi_user_cache is False and req.lora_path == []
    params = req.params()
    assert params.flash_attention and params.kv_size == 4096 and params.batch_size == 512

    multi_user = LoadRequest.from_json(body.replace(b'"Unknown"', b'"MultiUserCache": true, "Unknown"'))
    assert multi_user.multi_user_cache is True and multi_user.params().multi_user_cache is True
    assert not multi_user.same_layout(req)

    commit = LoadRequest.from_json(body.replace(b'"operation": 1', b'"operation": 2'))
    assert commit.same_layout(req) and not commit.same_layout(None)
    other = LoadRequest.from_json(body.replace(b'"PARALLEL": 2', b'"PARALLEL": 1'))
    assert not other.same_layout(req)


def test_load_request_zero_value_is_an_empty_object():
    """A LoadRequest made in Python starts from the zero values Go gives to missing keys."""
    assert LoadRequest() == LoadRequest.from_json(b"{}") == LoadRequest.from_json(b'{"GPULayers": null}')
    assert vars(LoadRequest()) == {
        "operation": LoadOperation.FIT, "lora_path": [], "parallel": 0, "batch_size": 0, "flash_attention": 0,
        "kv_size": 0, "kv_cache_type": "", "kv_cache_type_k": "", "kv_cache_type_v": "", "num_threads": 0,
        "gpu_layers": [], "multi_user_cache": False,
        "projector_path": "", "main_gpu": 0, "use_mmap": False, "draft_path": "",
    }


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"Operation": "fit"}', b'{"Parallel": true}',
                                  b'{"Operation": 9}', b'{"KvSize": 1.5}', b'{"GPULayers": [3]}'])
def test_load_request_rejects(body):
    with pytest.raises(WireError):
        LoadRequest.from_json(body)


def test_completion_request_options():
    defaults = CompletionRequest.from_json(b'{"Prompt": "hi", "Options": null}')
    assert defaults.prompt == "hi"
    assert defaults.options.num_predict == -1 and defaults.options.num_keep == 4
    assert defaults.options.sampler.temperature == pytest.approx(0.8) and defaults.options.sampler.top_k == 40
    assert defaults.options.shift is False and defaults.options.truncate is False
    assert defaults.options.top_logprobs == 0 and defaults.options.logprobs is False

    empty = CompletionRequest.from_json(b'{"Options": {}}').options  # present but empty: every key at zero
    assert (empty.num_predict, empty.num_keep, empty.stop, empty.sampler.temperature) == (0, 0, [], 0.0)
    assert CompletionRequest.from_json(b'{"TopLogprobs": 20}').options.top_logprobs == 20  # the most allowed

    # present options leave omitted keys at zero (the parent encodes them with omitempty)
    given = CompletionRequest.from_json(json.dumps({
        "prompt": "x", "options": {"num_predict": 5, "stop": ["\n"], "top_k": 3}, "Shift": True, "Truncate": True,
        "Logprobs": True, "TopLogprobs": 2,
    }).encode())
    o = given.options
    assert (o.num_predict, o.num_keep, o.stop, o.shift, o.truncate, o.logprobs, o.top_logprobs) == (
        5, 0, ["\n"], True, True, True, 2)
    assert o.sampler.temperature == 0.0 and o.sampler.top_k == 3
    assert given.grammar == "" and defaults.grammar == ""

    constrained = CompletionRequest.from_json(b'{"Prompt": "x", "Grammar": "root ::= \\"yes\\""}')
    assert constrained.grammar == 'root ::= "yes"'


@pytest.mark.parametrize("body", [b"nope", b'{"Prompt": 1}', b'{"Options": []}', b'{"Options": {"stop": "x"}}',
                                  b'{"Options": {"temperature": "hot"}}', b'{"TopLogprobs": 21}',
                                  b'{"Options": {"temperature": 1' + b'0' * 400 + b'}}',  # beyond float64 (issue 38)
                                  b'{"Options": {"top_p": 1' + b'0' * 400 + b'}}',
                                  b'{"Options": {"min_p": 1' + b'0' * 400 + b'}}'])
def test_completion_request_rejects(body):
    with pytest.raises(WireError):
        CompletionRequest.from_json(body)


# ---------------------------------------------------------------- HTTP without a model


def call(server: RunnerServer, method: str, path: str, body: bytes | None = None):
    async def run():
        async with runner_client(server) as client:
            response = await client.request(method, path, data=body)
            return response.status, response.headers.get("Content-Type"), await response.read()

    return asyncio.run(run())


def test_health_before_load():
    assert call(RunnerServer(None), "GET", "/health") == (200, "application/json", b'{"status":2,"progress":0}\n')


class FakeDevice(Device):
    """A ggml device without ggml: half of its memory is free."""

    def free_memory(self) -> int:
        return self.total_memory // 2


FAKE_DEVICES = (
    FakeDevice(None, "0", "CPU", "CPU", "AMD EPYC", "CPU", 64 * GIB),
    FakeDevice(None, "GPU-5c8c", "CUDA", "CUDA0", "NVIDIA H100 80GB HBM3", "GPU", 80 * GIB),
    FakeDevice(None, "0", "Vulkan", "Vulkan0", "AMD Radeon Graphics", "IGPU", 8 * GIB),
    FakeDevice(None, "0", "BLAS", "BLAS", "OpenBLAS", "ACCEL", 0),
)


def test_info_lists_gpus_only(monkeypatch):
    monkeypatch.setattr(device_module, "devices", lambda: FAKE_DEVICES)
    monkeypatch.setenv("OLLAMA_LIBRARY_PATH", os.pathsep.join(["/opt/ollama", "", "/opt/ollama/cuda"]))
    status, content_type, body = call(RunnerServer(None), "GET", "/info")
    assert (status, content_type) == (200, "application/json")
    library_path = ["/opt/ollama", "/opt/ollama/cuda"]
    assert json.loads(body) == [
        {"id": "GPU-5c8c", "backend": "CUDA", "name": "CUDA0", "description": "NVIDIA H100 80GB HBM3",
         "total_memory": 80 * GIB, "free_memory": 40 * GIB, "ComputeMajor": 0, "ComputeMinor": 0,
         "LibraryPath": library_path},
        {"id": "0", "backend": "Vulkan", "name": "Vulkan0", "description": "AMD Radeon Graphics", "integration": True,
         "total_memory": 8 * GIB, "free_memory": 4 * GIB, "ComputeMajor": 0, "ComputeMinor": 0,
         "LibraryPath": library_path},
    ]


def test_info_on_a_machine_without_gpus_is_an_empty_list(monkeypatch):
    monkeypatch.setattr(device_module, "devices", lambda: FAKE_DEVICES[:1])
    monkeypatch.delenv("OLLAMA_LIBRARY_PATH", raising=False)
    assert call(RunnerServer(None), "GET", "/info") == (200, "application/json", b"[]\n")


def test_load_errors():
    server = RunnerServer(None)
    assert call(server, "POST", "/load", b"{oops") == (400, "text/plain; charset=utf-8", b"bad request\n")
    status, _, body = call(server, "POST", "/load", b'{"Operation": 0, "Parallel": 1}')
    assert status == 500 and body.startswith(b"failed to initialize model: ")
    status, _, body = call(server, "POST", "/load", b'{"Operation": 0, "LoraPath": ["x"]}')
    assert (status, body) == (500, b"failed to initialize model: loras are not yet implemented\n")


def test_close_answers_an_empty_load_response():
    assert call(RunnerServer(None), "POST", "/load", b'{"Operation": 3}')[2] == (
        b'{"Success":false,"Memory":{"InputWeights":0,"CPU":{"id":"","Name":"","Weights":null,"Cache":null,'
        b'"Graph":0},"GPUs":null}}\n'
    )


def test_bad_completion_is_rejected_before_waiting_for_a_model():
    assert call(RunnerServer(None), "POST", "/completion", b"{") == (
        400, "text/plain; charset=utf-8", b"Bad request\n")


# ---------------------------------------------------------------- prompt truncation


def inputs(n: int, groups: dict[int, int] | None = None) -> list[Input]:
    return [Input(token=i, same_batch=(groups or {}).get(i, 0)) for i in range(n)]


@pytest.mark.parametrize(("n", "num_ctx", "num_keep", "groups", "expected_tokens", "expected_keep"), [
    (5, 10, 4, None, list(range(5)), 4),  # fits: untouched
    (12, 10, 4, None, [0, 1, 2, 3] + list(range(6, 12)), 4),  # keep 4, drop the 2 after them
    (12, 10, -1, None, list(range(9)) + [11], 9),  # keep everything: capped at num_ctx - 1
    (12, 10, 0, None, list(range(2, 12)), 0),
    (12, 10, 4, {5: 2}, [0, 1, 2, 3] + list(range(8, 12)), 4),  # the group 5..7 is dropped whole
    (12, 10, 2, {3: 1}, [0, 1] + list(range(5, 12)), 2),  # cut would land inside the group 3..4
])
def test_fit_prompt(n, num_ctx, num_keep, groups, expected_tokens, expected_keep):
    kept, keep = fit_prompt(inputs(n, groups), num_ctx, num_keep, truncate=True)
    assert [inp.token for inp in kept] == expected_tokens and keep == expected_keep
    assert len(kept) <= num_ctx


def test_fit_prompt_of_exactly_the_context_needs_no_truncation():
    kept, keep = fit_prompt(inputs(10), 10, 4, truncate=False)
    assert [inp.token for inp in kept] == list(range(10)) and keep == 4


def test_fit_prompt_errors():
    with pytest.raises(InputTooLongError, match="the input length exceeds the context length"):
        fit_prompt(inputs(11), 10, 4, truncate=False)
    with pytest.raises(ValueError, match="no input provided"):
        fit_prompt([], 10, 4, truncate=True)
    with pytest.raises(ValueError, match="SameBatch may not be specified within numKeep"):
        fit_prompt(inputs(12, {1: 1}), 10, 4, truncate=True)
    with pytest.raises(ValueError, match="entire prompt removed by truncation"):
        fit_prompt(inputs(12, {4: 7}), 10, 4, truncate=True)


class CountingLoop:
    """Counts the wake-ups that a LoopInbox asks of the running event loop, and checks each one delivers."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.inbox = LoopInbox(loop)
        self.wakeups = 0
        self.delivered = 0
        self.empty_wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            if callback != self.inbox._drain:
                return original(callback, *args)
            self.wakeups += 1

            def drain() -> None:
                before = self.delivered
                callback()
                self.empty_wakeups += self.delivered == before

            return original(drain, *args)

        loop.call_soon_threadsafe = counting

    def put(self, deliver, item) -> None:
        def counted(value) -> None:
            self.delivered += 1
            deliver(value)

        self.inbox.put(counted, item)


def test_loop_inbox_wakes_the_event_loop_once_per_burst_and_keeps_the_order():
    """A burst queued while the event loop is busy costs one wake-up, and the next burst one more.

    The event loop is held (blocked in join) until the burst is queued: a free loop may drain mid-burst,
    which is allowed, so only a held loop gives a count that a test can rely on.
    """

    async def run() -> tuple[dict[str, list[int]], list[int]]:
        counter = CountingLoop(asyncio.get_running_loop())
        received: dict[str, list[int]] = {"a": [], "b": []}
        wakeups = []
        for start in (0, 10):  # two steps of the batch loop: one piece for each of two sequences, ten times over
            done = asyncio.Event()

            def burst(start: int = start, done: asyncio.Event = done) -> None:
                for i in range(start, start + 10):
                    counter.put(received["a"].append, i)
                    counter.put(received["b"].append, i)
                counter.put(lambda _: done.set(), None)

            thread = threading.Thread(target=burst)
            thread.start()
            thread.join()  # blocks the event loop: nothing can be drained before the whole burst is queued
            await asyncio.wait_for(done.wait(), 5)
            wakeups.append(counter.wakeups)
        return received, wakeups

    received, wakeups = asyncio.run(run())
    assert received == {"a": list(range(20)), "b": list(range(20))}
    assert wakeups == [1, 2]


def test_loop_inbox_holds_a_step_and_wakes_the_event_loop_once_for_it():
    """What is put within hold() waits for its end, even with the event loop free to drain meanwhile."""

    async def run() -> tuple[list[int], int, int]:
        counter = CountingLoop(asyncio.get_running_loop())
        received: list[int] = []
        done = asyncio.Event()
        queued = threading.Event()

        def step() -> None:
            with counter.inbox.hold():
                for i in range(4):
                    counter.put(received.append, i)
                queued.set()
                time.sleep(0.05)  # the event loop is free here: nothing may reach it yet
                counter.put(lambda _: done.set(), None)

        thread = threading.Thread(target=step)
        thread.start()
        await asyncio.to_thread(queued.wait)
        await asyncio.sleep(0.02)
        early = len(received)
        await asyncio.wait_for(done.wait(), 5)
        thread.join()
        return received, early, counter.wakeups

    received, early, wakeups = asyncio.run(run())
    assert received == [0, 1, 2, 3] and early == 0 and wakeups == 1


def test_loop_inbox_under_contention_keeps_the_order_and_never_wakes_for_nothing():
    """With the event loop free to drain mid-burst, every item still arrives once, in order."""

    async def run() -> tuple[list[int], CountingLoop]:
        counter = CountingLoop(asyncio.get_running_loop())
        received: list[int] = []
        done = asyncio.Event()

        def burst() -> None:
            for i in range(2000):
                counter.put(received.append, i)
                if i % 100 == 0:
                    time.sleep(0.001)  # give the event loop a chance to drain in the middle
            counter.put(lambda _: done.set(), None)

        await asyncio.gather(asyncio.to_thread(burst), asyncio.wait_for(done.wait(), 10))
        return received, counter

    received, counter = asyncio.run(run())
    assert received == list(range(2000))
    assert 1 <= counter.wakeups <= 2001 and counter.empty_wakeups == 0
