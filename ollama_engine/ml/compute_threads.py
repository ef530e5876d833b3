"""Which threads run ggml's graph computes: one long-lived thread per process, or a thread that ends with its compute.

ggml's CPU backend is built with OpenMP. libgomp gives every thread that starts a parallel region (a graph
computed with more than one thread) a pool of worker threads, kept until that thread ends. While libgomp
manages more threads than there are CPUs, it stops spinning between parallel regions (its "throttled" spin
count: 100 instead of 300 000), so the workers of every pool fall asleep after each graph and each compute
must wake them through the kernel. A second long-lived thread that has computed once is enough: the runner's
batch builder computing a context shift (or a prefix copy) left its pool behind, and from then on every
decode step of stories260K took 3-5x as long as before, on the same graph (issue 33: "a single stream decodes
~5x slower after four streams", which was the first shift, not the streams).

So a graph is computed in place only on a thread that called compute_here() (the thread that runs a model's
forward graphs: the runner's compute thread, or its batch builder where that computes the batches itself), or
on the main thread while no other thread has: a script or a test computing on its main thread keeps one pool,
but in the runner the main thread runs the HTTP event loop, whose handlers may copy a cached prefix (runner.add
-> load_slot). A compute asked for from any other thread runs on a short-lived thread that ends right after it,
taking its pool with it. Those computes (cache shifts, prefix copies, vision towers) happen per request, not per
token: a thread start costs far less than they do. The runner's embeddings and rerank scores, whose whole
request is one compute, are instead handed to the thread that computes its batches (Runner.submit_compute).
Computes of one backend are serialized by its compute lock either way.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_local = threading.local()  # in_place: set by compute_here(); gone with its thread, so never inherited by a reused id
_claimed: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # the threads that called compute_here()


def compute_here() -> None:
    """Let the calling thread run graph computes itself from now on (its worker pool lives as long as it does).

    For the one thread of a process that computes every step; each further such thread is another pool.
    """
    if not getattr(_local, "in_place", False):
        _local.in_place = True
        _claimed.add(threading.current_thread())


def computes_in_place() -> bool:
    """Whether a compute asked for on the calling thread runs on it."""
    if getattr(_local, "in_place", False):
        return True
    main = threading.main_thread()
    return threading.current_thread() is main and not any(t.is_alive() for t in list(_claimed) if t is not main)


def run_compute(compute: Callable[[], T]) -> T:
    """compute() on this thread if it computes in place, else on a thread of its own that ends with it."""
    if computes_in_place():
        return compute()
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(compute())
        except BaseException as err:  # handed to the caller below
            error.append(err)

    thread = threading.Thread(target=target, name="ggml-side-compute", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:  # e.g. KeyboardInterrupt: the caller's compute lock must outlive the compute
        thread.join()
        raise
    if error:
        raise error[0]
    return result[0]
