"""ggml's RPC backend: this machine's devices served to other hosts, other hosts' devices used as local ones.

ggml's client is unforgiving: it aborts the whole process when a server cannot be reached or gives a bad
answer, and a server busy with another client (ggml's server serves one client at a time) leaves it waiting
for the handshake forever. So `add_server` first checks the endpoint with a plain socket and a timeout: it
connects, sends the HELLO that ggml sends, and checks the protocol version in the answer; only then does
ggml connect. A server that dies later makes ggml abort the process with an `error:` line on stderr, which
is how the parent learns that its runner crashed. A host that vanishes without closing the connection (power
lost, network cut) would leave ggml waiting on its socket forever: ggml sets no keep-alive, so a thread here
sets TCP keep-alive and a user timeout on ggml's sockets to the servers, and a dead host ends the wait (and
the runner, with its error) within about KEEPALIVE_SECONDS.

Endpoints are `host:port` with an IPv4 address or a host name (ggml's transport is IPv4 only).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
import threading
import time

from . import NULL, ffi, lib

AVAILABLE = hasattr(lib, "ggml_backend_rpc_add_server")
PROBE_TIMEOUT = 5.0  # seconds for the connect, and again for the answer to HELLO
_HELLO = 14  # RPC_CMD_HELLO, fixed across protocol versions
_CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE: all zero asks for plain TCP
KEEPALIVE_SECONDS = 30  # a silent host is given up after this long (keep-alive probes, unacknowledged data)
_registered: dict[str, list] = {}  # endpoint -> its device handles, registered with ggml once per process
_peers: set[tuple[str, int]] = set()  # (IPv4 address, port) of every registered server


class RpcError(RuntimeError):
    """An RPC endpoint that is malformed, unreachable, busy, or not a compatible ggml RPC server."""


def _require() -> None:
    if not AVAILABLE:
        raise RpcError("ggml was built without its RPC backend: run `python build_ggml.py --rpc`")


def parse_endpoint(text: str) -> tuple[str, int]:
    """`host:port` -> (host, port); a clear error for anything ggml's transport would not take."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or ":" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RpcError(f"invalid RPC server {text!r}: want host:port (an IPv4 address or a host name, and a port)")
    return host, int(port)


def parse_endpoints(text: str) -> list[str]:
    """A comma-separated list (OLLAMA_RPC_SERVERS) -> endpoints `host:port`, each checked, duplicates dropped."""
    endpoints = []
    for item in text.split(","):
        if item.strip():
            host, port = parse_endpoint(item)
            endpoints.append(f"{host}:{port}")
    return list(dict.fromkeys(endpoints))


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT) -> tuple[int, int, int]:
    """Connect and shake hands as ggml would; return the server's protocol version or raise RpcError."""
    _require()
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((_ipv4(host), port), timeout=timeout) as sock:
            sock.sendall(struct.pack("<BQ", _HELLO, _CAPS_SIZE) + bytes(_CAPS_SIZE))
            try:
                size = struct.unpack("<Q", _recv_exactly(sock, 8))[0]
                answer = _recv_exactly(sock, size) if size == 4 + _CAPS_SIZE else b""
            except TimeoutError:
                raise RpcError(
                    f"RPC server {endpoint} accepted the connection but did not answer within {timeout:g} s; "
                    "ggml's RPC server serves one client at a time: is another runner using it?"
                ) from None
    except RpcError:
        raise
    except OSError as err:
        raise RpcError(f"RPC server {endpoint} is unreachable: {err.strerror or err}") from None
    if not answer:
        raise RpcError(f"{endpoint} is not a ggml RPC server (its answer to HELLO is malformed)")
    version = (answer[0], answer[1], answer[2])
    if version[0] != lib.RPC_PROTO_MAJOR_VERSION or version[1] > lib.RPC_PROTO_MINOR_VERSION:
        ours = (lib.RPC_PROTO_MAJOR_VERSION, lib.RPC_PROTO_MINOR_VERSION, lib.RPC_PROTO_PATCH_VERSION)
        raise RpcError(f"RPC server {endpoint} speaks protocol {_dotted(version)}, this build {_dotted(ours)}: "
                       "build both from the same ggml")
    return version


def _ipv4(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as err:
        raise RpcError(f"RPC server host {host!r} does not resolve to an IPv4 address: {err}") from None


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("connection closed")
        data += chunk
    return data


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def add_server(endpoint: str, timeout: float = PROBE_TIMEOUT) -> list:
    """Register a server's devices with ggml (once per endpoint); return their ggml_backend_dev_t handles.

    After this they are among ggml's devices, of type GPU, named RPC0, RPC1, ... in the order added.
    """
    _require()
    host, port = parse_endpoint(endpoint)
    endpoint = f"{host}:{port}"
    if endpoint in _registered:
        return _registered[endpoint]
    probe(endpoint, timeout)
    lib.abort_with_error_prefix()  # a server lost later aborts this process: say so on stderr as an error
    reg = lib.ggml_backend_rpc_add_server(endpoint.encode())
    if reg == NULL:
        raise RpcError(f"RPC server {endpoint} offers no devices")
    lib.ggml_backend_register(reg)
    _registered[endpoint] = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]
    if sys.platform.startswith("linux") and not _peers:
        threading.Thread(target=_keep_alive_loop, name="rpc-keepalive", daemon=True).start()
    _peers.add((_ipv4(host), port))
    return _registered[endpoint]


def _keep_alive_loop(period: float = 1.0) -> None:
    while True:
        keep_alive_connections()
        time.sleep(period)


def keep_alive_connections() -> list[tuple[tuple[str, int], int, int]]:
    """Give this process's sockets to RPC servers keep-alive and a user timeout (Linux); for each such socket
    (peer, SO_KEEPALIVE, TCP_USER_TIMEOUT in ms) as they are now."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            duplicate = os.dup(int(name))  # ggml keeps its own descriptor; options are the socket's
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)
            continue
        with sock:
            try:
                if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM or sock.getpeername() not in _peers:
                    continue
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_SECONDS // 3)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_SECONDS // 6)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KEEPALIVE_SECONDS * 1000)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                found.append((sock.getpeername(), sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                              sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)))
            except OSError:  # not connected, or closed meanwhile
                continue
    return found


def serve(host: str, port: int, devices: list, threads: int) -> None:
    """Serve these ggml devices on host:port until the process ends (ggml's loop never returns on success).

    Returns (with RpcError) only when ggml could not start, e.g. the address is taken. The GIL is released
    meanwhile, so callers run it in a thread and keep the main thread for signals.
    """
    _require()
    if not devices:
        raise RpcError("no device to serve")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise RpcError(f"cannot listen on {host!r}: ggml's RPC server needs an IPv4 address "
                       "(127.0.0.1 for this machine only, 0.0.0.0 for every interface)") from None
    with socket.socket() as check:  # ggml only says "Failed to create server socket"; find out why first
        check.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            check.bind((host, port))
        except OSError as err:
            raise RpcError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    handles = ffi.new("ggml_backend_dev_t[]", devices)
    # no cache directory: ggml caches only tensors written in one piece of over 10 MiB, and the loader writes 4 MiB
    lib.ggml_backend_rpc_start_server(f"{host}:{port}".encode(), NULL, threads, len(devices), handles)
    raise RpcError(f"ggml's RPC server on {host}:{port} stopped (see its messages above)")
