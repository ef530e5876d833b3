"""The scheduler: loads runners on demand, shares them between requests, keeps them warm, evicts them."""

from ollama_engine.sched.scheduler import Scheduler
from ollama_engine.sched.types import (
    Context,
    LlmRequest,
    Model,
    ModelInfo,
    Options,
    RunnerFailedError,
    RunnerRef,
    ServerBusyError,
    StatusError,
)

__all__ = [
    "Context", "LlmRequest", "Model", "ModelInfo", "Options", "RunnerFailedError", "RunnerRef", "Scheduler",
    "ServerBusyError", "StatusError",
]
