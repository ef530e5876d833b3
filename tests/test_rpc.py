"""Layers on other hosts through ggml's RPC backend: two `ollama-engine rpc-server` processes on loopback.

A model split across both servers and the local CPU must give the single-host logits and greedy tokens,
through the layout loop as the scheduler drives it; a server that is unreachable, silent or lost mid-stream
must end in a clear error, never a hang. Anything that registers RPC devices runs in a subprocess: ggml's
device registry lives as long as the process, and a lost server aborts it.

Run as a script (`python tests/test_rpc.py MODEL [ENDPOINT ...]`) this file prints what one process computes:
the prompt's logits and greedy tokens, with layer i on the i-th endpoint and the other layers on the CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from serve_process import serve_process
from synthetic.models import write_synthetic

from ollama_engine.fs import GGUFFile
from ollama_engine.generate import prefill
from ollama_engine.ggml import rpc
from ollama_engine.kvcache import Batch
from ollama_engine.llm.discovery import discover_gpus, system_info
from ollama_engine.llm.load import LoadOptions, load
from ollama_engine.llm.runner_handle import RunnerError, RunnerHandle, free_port
from ollama_engine.ml import DType, GPULayers
from ollama_engine.ml.memory import DeviceID
from ollama_engine.models import load_model

PROMPT = "Once upon a time"
GREEDY_TOKENS = 32
TOLERANCE = 1e-4  # per logit; the measured difference is 0 (the same kernels, run on other processes)


def split_run(model: str, endpoints: list[str]) -> dict:
    """In this process: layer i on endpoints[i], the rest on the CPU; prompt logits and greedy tokens."""
    layout = [GPULayers(DeviceID(endpoint, "RPC"), [i]) for i, endpoint in enumerate(endpoints)]
    model = load_model(model, layout, num_threads=1)
    try:
        model.backend.load()
        model.cache.init(model.backend, DType.F16, 1, 256, 64)
        tokens = model.tokenizer.encode(PROMPT)
        n = len(tokens)
        logits = model.graphs.compute(Batch(positions=np.arange(n), sequences=np.zeros(n), outputs=range(n),
                                            tokens=tokens))
        greedy, last = [], logits[-1]
        for step in range(GREEDY_TOKENS):
            greedy.append(int(np.argmax(last)))
            last = prefill(model, [greedy[-1]], n + step)
        return {
            "logits": np.asarray(logits).tolist(),
            "tokens": greedy,
            "connections": rpc.keep_alive_connections() if endpoints else [],
            "layer_devices": [device.name for device in model.backend.layer_devices],
            "memory": model.backend.memory.to_json(),
        }
    finally:
        model.close()


pytestmark = pytest.mark.skipif(not rpc.AVAILABLE, reason="ggml was built without RPC (build_ggml.py --no-rpc)")


def start_rpc_server(port: int) -> subprocess.Popen:
    """`ollama-engine rpc-server` on loopback, once it answers the handshake."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ollama_engine", "rpc-server", "--port", str(port), "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            rpc.probe(f"127.0.0.1:{port}", timeout=5)
            return process
        except rpc.RpcError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"rpc-server did not start: {process.communicate()[1].decode()}") from None
            time.sleep(0.1)


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def servers():
    processes = {}
    try:
        for _ in range(2):
            port = free_port()
            processes[f"127.0.0.1:{port}"] = start_rpc_server(port)
        yield list(processes)
    finally:
        for process in processes.values():
            stop(process)


def run_split(model: Path, endpoints: list[str]) -> dict:
    env = {**os.environ, "OLLAMA_RPC_SERVERS": ",".join(endpoints)}
    result = subprocess.run([sys.executable, __file__, str(model), *endpoints], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_model_split_over_two_hosts_and_the_cpu_computes_what_one_host_does(servers, stories_path):
    single = run_split(stories_path, [])
    split = run_split(stories_path, servers)
    assert split["layer_devices"][:2] == [f"RPC[{servers[0]}]", f"RPC[{servers[1]}]"]
    assert set(split["layer_devices"][2:]) == {"CPU"}
    logits, expected = np.array(split["logits"]), np.array(single["logits"])
    assert logits.shape == expected.shape and np.abs(logits - expected).max() < TOLERANCE
    assert split["tokens"] == single["tokens"]
    # ggml's connections to both hosts end within rpc.KEEPALIVE_SECONDS if a host goes silent
    assert sorted({f"{host}:{port}" for (host, port), *_ in split["connections"]}) == sorted(servers)
    assert {(alive, timeout) for _, alive, timeout in split["connections"]} == {(1, rpc.KEEPALIVE_SECONDS * 1000)}
    # each host reports the weights and cache of its own layer, and nothing else
    for layer, endpoint in enumerate(servers):
        host = next(gpu for gpu in split["memory"]["GPUs"] if gpu["id"] == endpoint)
        assert host["backend"] == "RPC"
        assert [i for i, size in enumerate(host["Weights"]) if size] == [layer]
        assert [i for i, size in enumerate(host["Cache"]) if size] == [layer]


def greedy_text(handle: RunnerHandle) -> str:
    lines = list(handle.completion(PROMPT, {"num_predict": GREEDY_TOKENS, "temperature": 0}))
    assert lines[-1]["done"]
    return "".join(line.get("content", "") for line in lines)


def total_layers(model: Path) -> int:
    return GGUFFile.open(model).config.get_uint("block_count") + 1  # the repeating layers and the output


def loaded_runner(model: Path, endpoints: list[str], num_gpu: int, sched_spread: bool = False):
    """A runner placed by the parent's layout loop, as the scheduler does it; (handle, load result)."""
    handle = RunnerHandle.start(str(model), env={"OLLAMA_RPC_SERVERS": ",".join(endpoints)})
    try:
        handle.wait_launched()
        gpus = discover_gpus(handle)
        options = LoadOptions(num_ctx=256, batch_size=64, num_gpu=num_gpu, num_threads=1, sched_spread=sched_spread)
        result = load(handle, system_info(), gpus, total_layers(model), options)
        handle.wait_until_running()
    except BaseException:
        handle.close()
        raise
    return handle, gpus, result


def test_the_layout_loop_places_layers_on_the_hosts_like_gpus(servers, stories_path):
    with RunnerHandle.start(str(stories_path)) as alone:
        alone.wait_launched()
        load(alone, system_info(), [], total_layers(stories_path), LoadOptions(num_ctx=256, batch_size=64,
                                                                                num_threads=1))
        alone.wait_until_running()
        expected = greedy_text(alone)
    # OLLAMA_SCHED_SPREAD: 4 layers (num_gpu) over both hosts by their free memory; the others on the CPU
    handle, gpus, result = loaded_runner(stories_path, servers, num_gpu=4, sched_spread=True)
    with handle:
        assert [(gpu.device_id, gpu.name, gpu.description) for gpu in gpus] == [
            (DeviceID(endpoint, "RPC"), f"RPC[{endpoint}]", endpoint) for endpoint in servers
        ]
        assert all(gpu.free_memory > 0 for gpu in gpus)
        placed = {entry.device_id.id: entry.layers for entry in result.gpu_layers}
        assert sorted(placed) == sorted(servers) and all(placed.values())
        assert sum(len(layers) for layers in placed.values()) == 4
        for entry in result.memory.gpus:  # the memory table: what each host holds
            assert [i for i, size in enumerate(entry.weights) if size] == placed[entry.device_id.id]
            assert entry.graph > 0
        summary = result.memory.summary()
        assert {device for what, device, _ in summary if what == "model weights"} == {
            "CPU", *(f"RPC[{endpoint}]" for endpoint in servers)}
        assert greedy_text(handle) == expected


def test_an_unreachable_host_is_a_clear_load_error_not_a_hang(stories_path):
    closed = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with RunnerHandle.start(str(stories_path), env={"OLLAMA_RPC_SERVERS": closed}) as handle:
        handle.wait_launched()
        with pytest.raises(RunnerError, match=f"RPC server {closed} is unreachable: Connection refused"):
            discover_gpus(handle)
        with pytest.raises(RunnerError, match=f"RPC server {closed} is unreachable"):
            load(handle, system_info(), [], total_layers(stories_path), LoadOptions(num_ctx=256, batch_size=64))
        assert not handle.exited()
    assert time.monotonic() - started < 30


def test_a_host_that_accepts_but_never_answers_times_out_with_the_likely_reason():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # like a ggml server busy with another client
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(rpc.RpcError, match="did not answer within 0.5 s.*serves one client at a time"):
            rpc.probe(endpoint, timeout=0.5)
        assert time.monotonic() - started < 5


def test_a_host_that_is_not_a_ggml_rpc_server_is_named_as_such():
    with socket.create_server(("127.0.0.1", 0)) as other:
        endpoint = f"127.0.0.1:{other.getsockname()[1]}"

        def answer_like_http() -> None:
            connection, _ = other.accept()
            with connection:
                connection.recv(64)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer_like_http)
        thread.start()
        with pytest.raises(rpc.RpcError, match="is not a ggml RPC server"):
            rpc.probe(endpoint, timeout=5)
        thread.join()


@pytest.mark.parametrize("text", ["localhost", "host:", ":50052", "::1:50052", "host:0", "host:65536", "host:x"])
def test_malformed_endpoints_are_refused_before_ggml_sees_them(text):
    with pytest.raises(rpc.RpcError, match="want host:port"):
        rpc.parse_endpoints(f"127.0.0.1:50052,{text}")


def test_endpoints_list_drops_blanks_and_duplicates():
    assert rpc.parse_endpoints(" 10.0.0.2:50052,,10.0.0.3:50052 , 10.0.0.2:50052") == [
        "10.0.0.2:50052", "10.0.0.3:50052"]


def test_a_taken_port_is_a_clear_rpc_server_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "ollama_engine", "rpc-server", "--port", str(port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr


def test_a_host_lost_mid_stream_ends_the_runner_with_an_error(stories_path):
    port = free_port()
    server = start_rpc_server(port)
    endpoint = f"127.0.0.1:{port}"
    try:
        handle, _, result = loaded_runner(stories_path, [endpoint], num_gpu=2)
        with handle:
            assert [entry.device_id.id for entry in result.gpu_layers] == [endpoint]
            stream = handle.completion(PROMPT, {"num_predict": 10_000, "temperature": 0})
            first = next(stream)
            assert not first["done"]
            stop(server)
            lines = []
            with contextlib.suppress(OSError, ValueError, http.client.HTTPException):  # cut off, or just ended
                lines.extend(stream)
            assert not any(line["done"] for line in lines), "the stream must not end as if generation had finished"
            handle.process.wait(timeout=30)
            assert handle.process.returncode != 0
            reason = handle.exit_reason()
            assert "error: ggml aborted" in reason and "Remote RPC server crashed" in reason
    finally:
        stop(server)


def test_plan_shows_the_hosts_and_what_each_would_hold(servers, stories_path):
    result = subprocess.run(
        [sys.executable, "-m", "ollama_engine", "plan", str(stories_path), "--ctx", "256", "--num-gpu", "2",
         "--json", "--rpc-servers", ",".join(servers)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [(gpu["backend"], gpu["id"], gpu["name"]) for gpu in plan["gpus"]] == [
        ("RPC", endpoint, f"RPC[{endpoint}]") for endpoint in servers]
    [placed] = plan["layout"]
    assert placed["backend"] == "RPC" and placed["id"] in servers and len(placed["Layers"]) == 2
    host = next(gpu for gpu in plan["memory"]["GPUs"] if gpu["id"] == placed["id"])
    assert [i for i, size in enumerate(host["Weights"]) if size] == placed["Layers"]


def write_store(root: Path, model: Path) -> Path:
    """An Ollama model store (OLLAMA_MODELS) that names `model` tiny:latest."""
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").symlink_to(model)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
             "size": model.stat().st_size}
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))
    return root


def generate_lines(url: str, **body) -> tuple[int, list[dict]]:
    request = urllib.request.Request(url + "/api/generate", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, [json.loads(line) for line in response if line.strip()]
    except urllib.error.HTTPError as err:
        return err.code, [json.loads(err.read())]


def test_serve_recovers_from_a_host_lost_mid_stream(tmp_path):
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    server = start_rpc_server(port)
    store = write_store(tmp_path / "store", write_synthetic(tmp_path / "tiny.gguf", "tiny-llama", seed=1))
    try:
        with serve_process(store, OLLAMA_RPC_SERVERS=endpoint) as url:
            prompt = {"model": "tiny", "prompt": "Once upon a time"}
            status, lines = generate_lines(url, **prompt, options={"num_predict": 4, "temperature": 0})
            assert status == 200 and lines[-1]["done"]
            with urllib.request.urlopen(f"{url}/api/ps", timeout=30) as response:
                [row] = json.load(response)["models"]
            assert row["size_vram"] > 0  # its layers are on the host

            request = urllib.request.Request(url + "/api/generate", method="POST", data=json.dumps(
                {**prompt, "options": {"num_predict": 100_000}}).encode())
            with urllib.request.urlopen(request, timeout=120) as response:
                assert not json.loads(response.readline())["done"]
                stop(server)
                lines = [json.loads(line) for line in response if line.strip()]
            assert "Remote RPC server crashed" in lines[-1]["error"], lines[-1]

            status, [error] = generate_lines(url, **prompt)  # loading again: the host is still gone
            assert status == 500 and f"RPC server {endpoint} is unreachable" in error["error"], error

            server = start_rpc_server(port)  # back: the next request loads a fresh runner
            status, lines = generate_lines(url, **prompt, options={"num_predict": 4, "temperature": 0})
            assert status == 200 and lines[-1]["done"]
    finally:
        stop(server)


MAPPED_WEIGHTS = """
import json, sys
sys.path.insert(0, "tests")
from memory_checks import fitted_then_allocated
from ollama_engine.kvcache import Batch
from ollama_engine.ml import GPULayers
from ollama_engine.ml.memory import DeviceID
from ollama_engine.runner.allocate import LoadParams
path, endpoint, mapped = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
params = LoadParams(parallel=1, batch_size=32, kv_size=256, num_threads=1, use_mmap=mapped,
                    gpu_layers=(GPULayers(DeviceID(endpoint, "RPC"), [0, 1, 2, 3, 4, 5]),))
with fitted_then_allocated(path, params) as loaded:  # asserts fit == alloc
    graphs = loaded.model.graphs
    graphs.compute(Batch(positions=range(4), sequences=[0] * 4, outputs=[3], tokens=[1, 2, 3, 4]))
    graphs.compute(Batch(positions=[4], sequences=[0], outputs=[0], tokens=[5]))
    print(json.dumps(loaded.model.backend.scheduler.splits()))
"""


def test_mapped_weights_stay_where_they_are(servers, stories_path):
    """Weights mapped from the file are weights to ggml's scheduler, as read ones are: the token lookup runs
    on the CPU beside them, not on the host that computes every layer (which would copy the whole embedding
    matrix there at every step: a GPU's decode step took 48 ms instead of 4 on an 8B model), and fit's
    graph sizes are alloc's."""
    splits = {}
    for mapped in ("0", "1"):
        result = subprocess.run([sys.executable, "-c", MAPPED_WEIGHTS, str(stories_path), servers[0], mapped],
                                env={**os.environ, "OLLAMA_RPC_SERVERS": servers[0]}, capture_output=True,
                                text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
        assert result.returncode == 0, result.stderr[-2000:]
        splits[mapped] = json.loads(result.stdout.splitlines()[-1])
    assert splits["1"] == splits["0"] and splits["0"][0] == 2  # the lookup on the CPU, the layers on the host


RESPLIT = """
import json, sys
import numpy as np
from ollama_engine import ggml
from ollama_engine.ggml import NULL, lib
from ollama_engine.kvcache import Batch
from ollama_engine.ml import GPULayers
from ollama_engine.ml.memory import DeviceID
from ollama_engine.runner.allocate import LoadParams, open_model
path, endpoint = sys.argv[1], sys.argv[2]
params = LoadParams(parallel=1, batch_size=32, kv_size=256, num_threads=1,
                    gpu_layers=(GPULayers(DeviceID(endpoint, "RPC"), [3, 4, 5, 6]),))
loaded = open_model(path, params, allocate=True)
loaded.model.backend.load()
model, backend = loaded.model, loaded.model.backend

def sources(graph):
    nodes = [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]
    return [ggml.get_name(n.src[j]) for n in nodes for j in range(10) if n.src[j] != NULL]

prompt = Batch(positions=range(4), sequences=[0] * 4, outputs=[3], tokens=[1, 2, 3, 4])
decode = Batch(positions=[4], sequences=[0], outputs=[0], tokens=[5])
model.graphs.compute(prompt)
first = np.array(model.graphs.compute(decode))
graph = backend.allocated_graph
split = sources(graph)
backend.scheduler._as_built(graph)
built = sources(graph)
model.cache.remove(0, 0)
model.graphs.compute(prompt)  # another graph, then the decode graph split again
again = np.array(model.graphs.compute(decode))
print(json.dumps({"copies_after_split": sum("#" in n for n in split), "copies_as_built": sum("#" in n for n in built),
                  "same_logits": bool((first == again).all())}))
"""


def test_a_graph_split_again_starts_from_its_own_sources(servers, stories_path):
    """ggml's split points a graph's sources at its copies of tensors from another backend, and makes the copies
    anew at every split: a graph split again must get its own sources back first (a GPU's reserve otherwise laid
    a half-offloaded 8B's attention out on the CPU, 250 MB that fit had measured as 10). Here the layers cross
    from the CPU to an RPC host and back: the decode graph is split, split again after another graph, and
    computes the same logits."""
    result = subprocess.run([sys.executable, "-c", RESPLIT, str(stories_path), servers[0]],
                            env={**os.environ, "OLLAMA_RPC_SERVERS": servers[0]}, capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["copies_after_split"] > 0 and found["copies_as_built"] == 0, found
    assert found["same_logits"], found


if __name__ == "__main__":
    print(json.dumps(split_run(sys.argv[1], sys.argv[2:])))
    sys.exit(0)
