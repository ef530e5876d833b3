"""One place per decision (issue 37): num_ctx is fitted by one function, num_predict capped once, the RPC
servers passed down as values, the pending queue looked into without asyncio's private fields."""

from __future__ import annotations

import asyncio
import sys

import pytest

from ollama_engine.envconfig import EnvConfig, server_list
from ollama_engine.llm.runner_handle import runner_command
from ollama_engine.runner.sequence import capped_num_predict
from ollama_engine.sched.types import Context, LlmRequest, Model, Options, RequestQueue, fit_num_ctx


@pytest.mark.parametrize(("num_ctx", "train", "vision", "expected"), [
    (8192, 0, False, 8192),  # training context unknown: as asked
    (8192, 2048, False, 2048),  # at most the training context
    (1, 0, False, 4),  # at least 4
    (1, 2, False, 4),  # ... even above a (broken) training context of 2
    (512, 0, True, 2048),  # a vision model gets room for an image
    (512, 1024, True, 1024),  # ... within its training context
    (4096, 2048, True, 2048),
])
def test_num_ctx_is_fitted_in_one_place(num_ctx: int, train: int, vision: bool, expected: int) -> None:
    assert fit_num_ctx(num_ctx, train, vision) == expected


def test_resolved_options_use_the_request_or_the_default_and_fit_it() -> None:
    assert Options().resolved(4096, 2048).num_ctx == 2048
    assert Options(num_ctx=1).resolved(4096).num_ctx == 4
    assert Options(num_ctx=100).resolved(4096, 0, vision=True).num_ctx == 2048
    assert Options(num_ctx=100).resolved(4096).num_ctx == 100


@pytest.mark.parametrize(("num_predict", "num_ctx", "expected"), [
    (-1, 2048, 20480),  # "no limit" is 10 × num_ctx
    (0, 2048, 20480),  # the runner reads 0 as no limit too
    (100, 2048, 100),
    (20480, 2048, 20480),
    (20481, 2048, 20480),
    (-1, None, -1),  # nothing to cap by (never for a loaded runner: its options are resolved)
])
def test_num_predict_is_capped_at_ten_contexts(num_predict: int, num_ctx: int | None, expected: int) -> None:
    assert capped_num_predict(num_predict, num_ctx) == expected


def test_rpc_servers_are_config_and_reach_the_runner_as_a_flag() -> None:
    assert server_list(" a:1, ,b:2,") == ["a:1", "b:2"]
    assert EnvConfig.from_env({"OLLAMA_RPC_SERVERS": "10.0.0.1:50052,10.0.0.2:50052"}).rpc_servers == (
        "10.0.0.1:50052", "10.0.0.2:50052")
    assert EnvConfig.from_env({}).rpc_servers == ()
    command = runner_command("m.gguf", 1234, ("h:1", "h:2"))
    assert command[:3] == [sys.executable, "-m", "ollama_engine"]
    assert command[-2:] == ["--rpc-servers", "h:1,h:2"]
    assert "--rpc-servers" not in runner_command("m.gguf", 1234)


def test_the_pending_queue_is_a_bounded_fifo_that_can_be_looked_into() -> None:
    asyncio.run(asyncio.wait_for(pending_queue_checks(), 10))


async def pending_queue_checks() -> None:
    queue = RequestQueue(2)
    first, second, third = (LlmRequest(Context(), Model(name=n), Options()) for n in "abc")
    waiter = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    queue.put_nowait(first)
    assert await asyncio.wait_for(waiter, 1) is first and queue.empty()
    queue.put_nowait(second)
    queue.put_nowait(third)
    with pytest.raises(asyncio.QueueFull):
        queue.put_nowait(first)
    assert queue.snapshot() == [second, third] and queue.qsize() == 2
    assert queue.get_nowait() is second and await queue.get() is third
    with pytest.raises(asyncio.QueueEmpty):
        queue.get_nowait()
