"""POST /api/blobs/:digest streams to disk (issue 30): no size limit but the disk, serve's memory flat, nothing left
behind by a digest mismatch, a client gone half-way or a killed serve (its temp files go at the next start), and our
`create` command streams the file with progress.

Before the fix a blob over 1 GiB was refused with 413 after serve's memory grew by 1 GiB.
Rerun: .venv/bin/python -m pytest -q tests/test_blobs_streaming.py
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest
from serve_process import free_port, wait_until_serving

from ollama_engine.store import Store
from ollama_engine.store.disk import DIGEST_RE

MiB = 1 << 20
BIG = (1 << 30) + 64 * MiB + 7  # over the old 1 GiB body limit
RSS_GROWTH_LIMIT = 64 * MiB


@contextlib.contextmanager
def serve(models: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `ollama-engine serve` on `models`; (url, process)."""
    port = free_port()
    env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{port}", "OLLAMA_MODELS": str(models)}
    log_path = models.parent / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "ollama_engine", "serve"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, process, log_path)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def memory_kib(pid: int, field: str) -> int:
    """VmRSS / VmHWM of a process, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def generated_file(path: Path, size: int) -> Path:
    """A sparse file of `size` bytes (no disk used) with a few non-zero marks, so its digest is its own."""
    with open(path, "wb") as f:
        f.truncate(size)
        for offset in (0, size // 3, size - 16):
            f.seek(offset)
            f.write(hashlib.sha256(str(offset).encode()).digest()[:16])
    return path


def store_files(models: Path) -> list[str]:
    blobs = models / "blobs"
    return sorted(p.name for p in blobs.iterdir()) if blobs.is_dir() else []


def test_a_blob_over_1_gib_streams_through_the_official_client_with_flat_memory(tmp_path: Path) -> None:
    models = tmp_path / "models"
    source = generated_file(tmp_path / "big.gguf", BIG)
    try:
        with serve(models) as (url, process):
            client = ollama.Client(host=url)
            client.create_blob(generated_file(tmp_path / "small.bin", 3 * MiB))  # warm: every code path once
            baseline = memory_kib(process.pid, "VmRSS")
            peak, done = [baseline], threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak.append(memory_kib(process.pid, "VmRSS"))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            start = time.monotonic()
            digest = client.create_blob(source)
            seconds = time.monotonic() - start
            done.set()
            sampler.join()
            high_water = memory_kib(process.pid, "VmHWM")
            blob = Store(models).blob_path(digest)
            assert blob.stat().st_size == BIG
            growth = max(max(peak) - baseline, 0) * 1024
            print(f"\nupload of {BIG / MiB:.0f} MiB (hash in the client, then POST): {seconds:.1f} s, "
                  f"serve RSS {baseline / 1024:.0f} MiB -> peak sampled {max(peak) / 1024:.0f} MiB, "
                  f"VmHWM {high_water / 1024:.0f} MiB")
            assert growth < RSS_GROWTH_LIMIT, f"serve's RSS grew by {growth / MiB:.0f} MiB"
            assert (high_water - baseline) * 1024 < RSS_GROWTH_LIMIT
            assert [name for name in store_files(models) if not DIGEST_RE.fullmatch(name)] == []
    finally:
        for path in (models / "blobs").glob("*"):  # keep the disk as it was: 1 GiB is not left in /tmp
            path.unlink()
        source.unlink()


def test_a_digest_mismatch_leaves_nothing(tmp_path: Path) -> None:
    models = tmp_path / "models"
    claimed = "sha256:" + hashlib.sha256(b"something else").hexdigest()
    with serve(models) as (url, _):
        with open(generated_file(tmp_path / "data.bin", 5 * MiB), "rb") as f:
            request = urllib.request.Request(f"{url}/api/blobs/{claimed}", data=f.read(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 400 and b"digest mismatch" in caught.value.read()
        assert store_files(models) == []


def test_a_client_gone_half_way_leaves_nothing(tmp_path: Path) -> None:
    """The body goes to a temp file as it comes (seen in blobs/ mid-upload); the client hangs up: it is removed."""
    models = tmp_path / "models"
    digest = "sha256:" + "ab" * 32
    with serve(models) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         f"Content-Length: {100 * MiB}\r\n\r\n".encode())
            for _ in range(8):
                sock.sendall(bytes(MiB))
            deadline = time.monotonic() + 10
            while not store_files(models):  # streamed: the temp file exists before the body ends
                assert time.monotonic() < deadline, "nothing was written while the body came"
                time.sleep(0.02)
        deadline = time.monotonic() + 10
        while store_files(models):
            assert time.monotonic() < deadline, f"left behind: {store_files(models)}"
            time.sleep(0.05)


def test_temp_files_of_a_killed_serve_are_removed_at_start(tmp_path: Path) -> None:
    models = tmp_path / "models"
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid nobody has now: the killed serve's
    blobs, manifests = models / "blobs", models / "manifests" / "registry.ollama.ai" / "library" / "m"
    blobs.mkdir(parents=True)
    manifests.mkdir(parents=True)
    stale = [blobs / f".blob.{dead.pid}.0123456789abcdef.partial", blobs / f"tmp-{dead.pid}-140234",
             blobs / f"tmp-pull-{dead.pid}-0123456789abcdef",
             manifests / f".latest.{dead.pid}.fedcba9876543210.partial"]
    live = blobs / f".blob.{os.getpid()}.0123456789abcdef.partial"  # a second serve's upload in progress
    kept = [live, blobs / ("sha256-" + "cd" * 32), blobs / ("sha256-" + "ef" * 32 + "-partial")]  # Ollama's own
    for path in stale + kept:
        path.write_bytes(b"x")
    with serve(models):
        pass
    assert [path for path in stale if path.exists()] == []
    assert all(path.exists() for path in kept)


def test_the_create_command_streams_the_file_with_progress(tmp_path: Path) -> None:
    """`ollama-engine create` uploads FROM ./file with its length, never reading it whole, and shows progress."""
    models = tmp_path / "models"
    size = 384 * MiB
    source = generated_file(tmp_path / "model.gguf", size)
    (tmp_path / "Modelfile").write_text("FROM ./model.gguf\n")
    try:
        with serve(models) as (url, _):
            env = {**os.environ, "OLLAMA_HOST": url.removeprefix("http://")}
            log = tmp_path / "create.log"  # a file, not a pipe: progress lines cannot fill it and block the client
            with log.open("w") as sink:
                process = subprocess.Popen([sys.executable, "-m", "ollama_engine", "create", "big", "-f",
                                            str(tmp_path / "Modelfile")], env=env, stdout=sink, stderr=sink)
                peak = 0  # VmHWM of the client's own image (rusage's maxrss counts pytest's, from before exec)
                while process.poll() is None:
                    try:
                        status = Path(f"/proc/{process.pid}/status").read_text()
                        peak = max(peak, int(status.split("VmHWM:")[1].split()[0]) * 1024)
                    except (OSError, IndexError, ValueError):
                        pass
                    time.sleep(0.02)
            stderr = log.read_text()
            digest = "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest()
            assert f"copying file {digest} 100%" in stderr, stderr
            assert Store(models).blob_path(digest).stat().st_size == size
            assert 0 < peak < size // 2, f"the client's peak RSS: {peak / MiB:.0f} MiB for a {size / MiB:.0f} MiB file"
            assert "not in GGUF format" in stderr  # serve still checks what it got (the marks are not a GGUF)
    finally:
        for path in (models / "blobs").glob("*"):
            path.unlink()
        source.unlink()


def test_the_process_limit_of_the_test_machine_allows_big_files() -> None:
    """A sanity check for the tests above: no RLIMIT_FSIZE below the big blob."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    assert soft == resource.RLIM_INFINITY or soft > BIG
