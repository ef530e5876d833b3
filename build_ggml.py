#!/usr/bin/env python3
"""Build ggml from the pinned source distribution and compile the cffi bindings against it.

Steps (each skipped when its output is already up to date):
  1. source:  pip downloads the sdist pinned in vendor/ggml-source.json, checks its sha256, extracts it
              under build/src/ (or --source DIR uses a llama.cpp tree already on disk);
  2. ggml:    CMake configures the llama.cpp root with everything but ggml switched off and builds the
              `ggml` target as shared libraries, copied to ollama_engine/ggml/lib/; ggml's RPC backend
              (layers on other hosts) is part of it unless --no-rpc;
  3. cffi:    the declarations of ggml.h, ggml-alloc.h, ggml-backend.h, ggml-cpu.h, gguf.h (and ggml-rpc.h)
              are taken from the preprocessed headers and compiled in cffi API mode, so the C compiler checks
              every one of them against the real headers; with them a few lines of our own C (a CPU buffer
              type that puts tensors on cache lines, CACHE_LINE_BUFFER_TYPE below, and ERROR_PREFIXED_ABORT).

A second run with nothing changed only compares a stamp file and returns in well under a second.
`--fetch-only` does step 1 alone (dev.py builds the llama.cpp reference from the same source distribution).
On a terminal the compilation shows one progress line; elsewhere (a log) every progress line of make.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("OLLAMA_ENGINE_BUILD_DIR", ROOT / "build"))
PIN_FILE = ROOT / "vendor" / "ggml-source.json"
PACKAGE_DIR = ROOT / "ollama_engine" / "ggml"
LIB_DIR = PACKAGE_DIR / "lib"
STAMP = BUILD / "build-stamp.json"
SOURCE_MARKER = BUILD / "source-path.txt"
MODULE = "_ggml_cffi"
HEADERS = ["ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h", "gguf.h"]
RPC_HEADER = "ggml-rpc.h"
LLAMA_OFF = [
    "LLAMA_BUILD_TESTS",
    "LLAMA_BUILD_EXAMPLES",
    "LLAMA_BUILD_TOOLS",
    "LLAMA_BUILD_SERVER",
    "LLAMA_BUILD_COMMON",
    "LLAMA_CURL",
    "LLAMA_OPENSSL",
]


class BuildError(RuntimeError):
    """A build step failed; the message says which one and what to do."""


def step(message: str) -> None:
    print(f"[build_ggml] {message}", flush=True)


# ---------------------------------------------------------------- source


def read_pin() -> dict:
    return json.loads(PIN_FILE.read_text())


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_source(pin: dict) -> Path:
    """Download (with pip) and extract the pinned sdist; return the llama.cpp root inside it."""
    tree = BUILD / "src" / pin["llama_cpp_dir"]
    sdist = BUILD / pin["sdist"]
    if tree.joinpath("ggml", "include", "ggml.h").exists() and sdist.exists():
        return tree
    BUILD.mkdir(parents=True, exist_ok=True)
    if not sdist.exists():
        step(f"downloading {pin['package']}=={pin['version']} (source distribution) with pip")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"{pin['package']}=={pin['version']}", "-d", str(BUILD)]
        result = None
        if importlib.util.find_spec("scikit_build_core"):  # the sdist's build backend: no isolated env needed
            result = subprocess.run([*cmd, "--no-build-isolation"], capture_output=True, text=True)
        if result is None or result.returncode != 0 or not sdist.exists():
            result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not sdist.exists():
            raise BuildError(f"pip could not download {pin['sdist']}:\n{result.stderr[-2000:]}")
    actual = sha256_of(sdist)
    if actual != pin["sha256"]:
        sdist.unlink()
        raise BuildError(f"{pin['sdist']} has sha256 {actual}, expected {pin['sha256']} (vendor/ggml-source.json); "
                         "refusing to build from it (the file was deleted)")
    step(f"extracting {pin['sdist']} (sha256 verified)")
    target = BUILD / "src"
    if target.exists():
        shutil.rmtree(target)
    with tarfile.open(sdist) as archive:
        archive.extractall(target, filter="data")
    if not tree.joinpath("ggml", "include", "ggml.h").exists():
        raise BuildError(f"{pin['sdist']} has no {pin['llama_cpp_dir']}/ggml/include/ggml.h")
    return tree


# ---------------------------------------------------------------- ggml (CMake)


def require_tool(name: str, why: str) -> str:
    path = shutil.which(name)
    if not path:
        raise BuildError(f"'{name}' was not found on PATH; {why}")
    return path


def cuda_architectures(explicit: str | None) -> str:
    """The visible GPU's compute capability (e.g. '90' for an H100), unless given."""
    if explicit:
        return explicit
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True)
        caps = sorted({line.strip().replace(".", "") for line in out.stdout.splitlines() if line.strip()})
        if out.returncode == 0 and caps:
            return ";".join(caps)
    return "native"


# ggml 0.25.3's AMX kernels crash (SIGSEGV in ggml_backend_amx_mul_mat, in llama.cpp's own build as well) on
# the Xeons with AMX this project runs on; -march=native would compile them in. The llama.cpp reference that
# the tests compare with is built with the same flags (dev.py), so both run the same kernels.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def compiler_cmake_args() -> list[str]:
    """Compiler flags for every ggml build of this project, ours and the reference's."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return []


def cmake_options(args: argparse.Namespace) -> list[str]:
    options = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DGGML_NATIVE=" + ("OFF" if args.portable else "ON"),
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    ] + [f"-D{name}=OFF" for name in LLAMA_OFF]
    if args.cuda:
        options += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_architectures(args.cuda_arch)}"]
    if args.vulkan:
        options.append("-DGGML_VULKAN=ON")
    # RDMA off: it would link libibverbs wherever CMake finds it, and TCP is what every host has
    options += ["-DGGML_RPC=ON", "-DGGML_RPC_RDMA=OFF"] if args.rpc else ["-DGGML_RPC=OFF"]
    return options + compiler_cmake_args() + list(args.cmake_arg)


def run_logged(cmd: list[str], log: Path, show_progress: bool) -> None:
    """Run a command, keep its whole output in a log, show only the progress lines.

    On a terminal, one line rewritten in place; elsewhere (dev.py's log) every progress line.
    """
    tty = sys.stdout.isatty()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            if show_progress and re.match(r"\[\s*\d+%\]", line):
                if tty:
                    width = shutil.get_terminal_size().columns - 1
                    print(f"\r\033[K  {line.rstrip()}"[:width], end="", flush=True)
                else:
                    print("  " + line.rstrip()[:120], flush=True)
        proc.wait()
        if show_progress and tty:
            print("\r\033[K", end="", flush=True)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise BuildError(f"{' '.join(cmd[:3])} failed (full log: {log}):\n{tail}")


def build_ggml(tree: Path, args: argparse.Namespace) -> list[str]:
    """Configure and build the ggml target; copy the shared libraries; return their link names."""
    require_tool("cmake", "install CMake >= 3.14 (e.g. `apt-get install cmake` or `pip install cmake`)")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        raise BuildError("no C/C++ compiler found; install one (e.g. `apt-get install build-essential`)")
    if args.cuda:
        require_tool("nvcc", "the CUDA toolkit is needed for --cuda (or put its bin/ folder on PATH)")
    build_dir = BUILD / ("ggml-cuda" if args.cuda else "ggml-cpu")
    build_dir.mkdir(parents=True, exist_ok=True)
    step(f"configuring ggml with CMake in {build_dir}")
    run_logged(["cmake", "-S", str(tree), "-B", str(build_dir)] + cmake_options(args),
               build_dir / "configure.log", show_progress=False)
    step(f"compiling ggml on {args.jobs} cores (log: {build_dir / 'build.log'})")
    run_logged(["cmake", "--build", str(build_dir), "--target", "ggml", "-j", str(args.jobs)],
               build_dir / "build.log", show_progress=True)
    built = sorted(build_dir.joinpath("bin").glob("libggml*.so*"))
    if not built:
        raise BuildError(f"the build produced no libggml*.so in {build_dir / 'bin'}")
    if LIB_DIR.exists():
        shutil.rmtree(LIB_DIR)
    LIB_DIR.mkdir(parents=True)
    for lib in built:
        shutil.copy2(lib, LIB_DIR / lib.name, follow_symlinks=False)
    return sorted({lib.name[3:].split(".so")[0] for lib in built})


# ---------------------------------------------------------------- cffi bindings


def exported_symbols() -> Callable[[str], bool]:
    """Whether the built libraries define a symbol (some headers declare functions no library defines)."""
    import ctypes

    handles = [ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL) for lib in sorted(LIB_DIR.glob("libggml*.so"))]
    return lambda name: any(hasattr(handle, name) for handle in handles)


def drop_undefined_functions(source: str, is_exported: Callable[[str], bool]) -> str:
    """Remove top-level function declarations whose symbol no library exports (cffi would fail to link)."""
    statements, depth, start = [], 0, 0
    for i, char in enumerate(source):
        depth += char in "{("
        depth -= char in "})"
        if char == ";" and depth == 0:
            statements.append(source[start : i + 1])
            start = i + 1
    kept = []
    for statement in statements:
        text = " ".join(statement.split())
        call = re.match(r"(?:extern )?[\w\s\*]*?(\w+)\s*\(", text)
        is_function = call and not re.match(r"(typedef|struct \w+ \{|enum|union)", text) and "{" not in text
        if is_function and not is_exported(call.group(1)):
            continue
        kept.append(statement)
    return "".join(kept)


def header_declarations(include_dir: Path, is_exported: Callable[[str], bool], headers: list[str]) -> str:
    """The C declarations of these headers, preprocessed, without system headers, in cffi's cdef dialect."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise BuildError("no C compiler found for preprocessing the ggml headers")
    umbrella = "".join(f'#include "{h}"\n' for h in headers)
    result = subprocess.run([compiler, "-E", "-I", str(include_dir), "-D__attribute__(x)=", "-"],
                            input=umbrella, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"preprocessing the ggml headers failed:\n{result.stderr[-2000:]}")
    kept, keep = [], False
    for line in result.stdout.splitlines():
        marker = re.match(r'# \d+ "([^"]+)"', line)
        if marker:
            keep = Path(marker.group(1)).name in headers
            continue
        if keep:
            kept.append(line)
    source = "\n".join(kept)
    source = source.replace("sizeof(int32_t)", "4")
    source = re.sub(r"\[([0-9 */+-]+)\]", lambda m: f"[{int(eval(m.group(1)))}]", source)  # noqa: S307
    source = re.sub(r"^\s*static const [^;]*;\s*$", "", source, flags=re.M)
    seen: set[str] = set()
    lines = []
    for line in source.splitlines():  # the headers repeat some opaque typedefs
        text = line.strip()
        if text.startswith("typedef") and text.endswith(";") and "(" not in text:
            if text in seen:
                continue
            seen.add(text)
        lines.append(line)
    return "typedef struct _IO_FILE FILE;\n" + drop_undefined_functions("\n".join(lines), is_exported)


# Our own C, compiled into the extension: the CPU buffer type for compute buffers, with every tensor on a
# 64-byte cache line. ggml's CPU buffer type aligns tensors to 32 bytes only; then threads that write
# neighbouring 64-byte tiles of one output (the attention scores' matmul) share cache lines, which was
# measured to slow that matmul by 20-40% on 2 threads. The buffers it allocates are ordinary CPU buffers.
CACHE_LINE_BUFFER_TYPE = """
#include "ggml-backend-impl.h"

static const char * cache_line_name(ggml_backend_buffer_type_t buft) { (void) buft; return "CPU"; }
static size_t cache_line_alignment(ggml_backend_buffer_type_t buft) { (void) buft; return 64; }
static bool cache_line_is_host(ggml_backend_buffer_type_t buft) { (void) buft; return true; }
static ggml_backend_buffer_t cache_line_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    (void) buft;
    return ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
}

static ggml_backend_buffer_type_t cpu_cache_line_buffer_type(void) {
    static struct ggml_backend_buffer_type buft = {
        {cache_line_name, cache_line_alloc, cache_line_alignment, NULL, NULL, cache_line_is_host}, NULL, NULL};
    buft.device = ggml_backend_buft_get_device(ggml_backend_cpu_buffer_type());
    return &buft;
}
"""


# ggml's scheduler, splitting a graph over several backends, points the sources of the nodes that read another
# backend's tensor at its copies of them, made in its own context and made anew at every split. A graph split
# again (a reserve after a measure, or computed again after another graph) would start from those stale copies
# (a half-offloaded 8B's reserve then laid the CPU's attention out where the measure had put it on the GPU:
# 250 MB against 10); so the sources a graph was built with are kept and put back before each split.
# Likewise its allocation: ggml's allocator leaves a tensor that has memory where it is, and after another graph
# the compute buffers may have moved (grown: freed and made anew), so the tensors the scheduler allocates are
# given no memory again, as built, before each split.
GRAPH_SOURCES = """
static size_t graph_source_slots(struct ggml_cgraph * graph) {
    return (size_t) ggml_graph_n_nodes(graph) * GGML_MAX_SRC;
}

static void graph_save_sources(struct ggml_cgraph * graph, struct ggml_tensor ** saved) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * node = ggml_graph_node(graph, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) saved[(size_t) i * GGML_MAX_SRC + j] = node->src[j];
    }
}

static void graph_restore_sources(struct ggml_cgraph * graph, struct ggml_tensor ** saved) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * node = ggml_graph_node(graph, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) node->src[j] = saved[(size_t) i * GGML_MAX_SRC + j];
    }
}

static size_t remember_unallocated(struct ggml_tensor * t, struct ggml_tensor ** out, size_t n) {
    for (; t != NULL; t = t->view_src) {  /* a view and what it views */
        if (t->data == NULL && t->buffer == NULL) {
            if (out != NULL) out[n] = t;
            n++;
        }
    }
    return n;
}

/* The tensors of the graph with no memory as built (the scheduler's to allocate: nodes, inputs, their views),
   into out (NULL: only counted); duplicates are harmless. */
static size_t graph_unallocated(struct ggml_cgraph * graph, struct ggml_tensor ** out) {
    size_t n = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * node = ggml_graph_node(graph, i);
        n = remember_unallocated(node, out, n);
        for (int j = 0; j < GGML_MAX_SRC; j++) n = remember_unallocated(node->src[j], out, n);
    }
    return n;
}

static void graph_forget_allocation(struct ggml_tensor ** tensors, size_t n) {
    for (size_t i = 0; i < n; i++) {
        tensors[i]->data = NULL;
        tensors[i]->buffer = NULL;
    }
}
"""


# ggml aborts the process on a failed assertion or a lost RPC connection, after printing the bare message. Our
# runner's parent reports a crashed runner by its stderr lines that start with "error:" (as Ollama's does); with
# this prefix a vanished RPC host is reported as such rather than as "exit code -6".
ERROR_PREFIXED_ABORT = """
#include <stdio.h>

void ggml_print_backtrace(void);  /* ggml-impl.h: exported by libggml-base, not in the public headers */

static void error_prefixed_abort(const char * message) {
    fprintf(stderr, "error: ggml aborted: %s\\n", message);
    fflush(stderr);
    ggml_print_backtrace();  /* what ggml prints without a callback */
}

static void abort_with_error_prefix(void) { ggml_set_abort_callback(error_prefixed_abort); }
"""


def compile_bindings(tree: Path, libraries: list[str]) -> None:
    import cffi

    include_dir = tree / "ggml" / "include"
    headers = HEADERS + ([RPC_HEADER] if "ggml-rpc" in libraries else [])
    ffi = cffi.FFI()
    ffi.cdef(header_declarations(include_dir, exported_symbols(), headers))
    ffi.cdef("ggml_backend_buffer_type_t cpu_cache_line_buffer_type(void);")
    ffi.cdef("void abort_with_error_prefix(void);")
    ffi.cdef("size_t graph_source_slots(struct ggml_cgraph *);\n"
             "void graph_save_sources(struct ggml_cgraph *, struct ggml_tensor **);\n"
             "void graph_restore_sources(struct ggml_cgraph *, struct ggml_tensor **);\n"
             "size_t graph_unallocated(struct ggml_cgraph *, struct ggml_tensor **);\n"
             "void graph_forget_allocation(struct ggml_tensor **, size_t);")
    if RPC_HEADER in headers:  # the protocol version, for checking a server before ggml connects to it
        ffi.cdef("#define RPC_PROTO_MAJOR_VERSION ...\n#define RPC_PROTO_MINOR_VERSION ...\n"
                 "#define RPC_PROTO_PATCH_VERSION ...")
    ffi.set_source(
        f"ollama_engine.ggml.{MODULE}",
        "".join(f'#include "{h}"\n' for h in headers) + CACHE_LINE_BUFFER_TYPE + GRAPH_SOURCES + ERROR_PREFIXED_ABORT,
        include_dirs=[str(include_dir), str(tree / "ggml" / "src")],
        library_dirs=[str(LIB_DIR)],
        libraries=libraries,
        # -O1 -g0: the wrappers are thin (arguments in, one call, the result out), so -O3 -g (Python's defaults)
        # bought nothing measurable per call, and compiling them took 11 s instead of 4 s on 2 cores
        extra_compile_args=["-Wno-deprecated-declarations", "-O1", "-g0"],
        extra_link_args=["-Wl,-rpath,$ORIGIN/lib", "-Wl,--disable-new-dtags"],
    )
    step("compiling the cffi extension (API mode)")
    work = BUILD / "cffi"
    work.mkdir(parents=True, exist_ok=True)
    built = Path(ffi.compile(tmpdir=str(work), verbose=False))
    for old in PACKAGE_DIR.glob(f"{MODULE}*.so"):
        old.unlink()
    shutil.copy2(built, PACKAGE_DIR / built.name)


# ---------------------------------------------------------------- driver


def fingerprint(args: argparse.Namespace, tree: Path) -> dict:
    return {
        "pin": read_pin(),
        "source": str(tree),
        "script": sha256_of(Path(__file__)),
        "options": {"cuda": args.cuda, "cuda_arch": args.cuda_arch, "vulkan": args.vulkan, "rpc": args.rpc,
                    "portable": args.portable, "cmake_arg": args.cmake_arg},
        "python": sys.version,
    }


def up_to_date(expected: dict) -> bool:
    if not STAMP.exists() or not list(PACKAGE_DIR.glob(f"{MODULE}*.so")) or not LIB_DIR.exists():
        return False
    try:
        return json.loads(STAMP.read_text()) == expected
    except json.JSONDecodeError:
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="build from this llama.cpp tree instead of downloading")
    parser.add_argument("--cuda", action="store_true", help="build the CUDA backend (needs nvcc)")
    parser.add_argument("--cuda-arch", help="CMAKE_CUDA_ARCHITECTURES (default: the visible GPU's)")
    parser.add_argument("--vulkan", action="store_true", help="build the Vulkan backend")
    parser.add_argument("--rpc", action=argparse.BooleanOptionalAction, default=True,
                        help="ggml's RPC backend, to place layers on other hosts (default: on; --no-rpc leaves it out)")
    parser.add_argument("--portable", action="store_true", help="no -march=native (GGML_NATIVE=OFF)")
    parser.add_argument("--cmake-arg", action="append", default=[], help="extra CMake flag, e.g. -DGGML_AVX512=OFF")
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--fetch-only", action="store_true",
                        help="only download, verify and extract the pinned source (step 1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        if args.fetch_only:
            pin = read_pin()
            fetched = BUILD.joinpath(pin["sdist"]).exists() and BUILD.joinpath("src", pin["llama_cpp_dir"]).exists()
            tree = fetch_source(pin)
            step("up to date" if fetched else f"source ready in {tree}")
            return 0
        if args.source:
            tree = args.source.resolve()
            if not tree.joinpath("ggml", "include", "ggml.h").exists():
                raise BuildError(f"{tree} is not a llama.cpp tree (no ggml/include/ggml.h)")
        else:
            tree = BUILD / "src" / read_pin()["llama_cpp_dir"]
        expected = fingerprint(args, tree)
        if not args.force and up_to_date(expected):
            step("up to date")
            return 0
        if not args.source:
            tree = fetch_source(read_pin())
        libraries = build_ggml(tree, args)
        compile_bindings(tree, libraries)
        BUILD.mkdir(parents=True, exist_ok=True)
        SOURCE_MARKER.write_text(str(tree))
        STAMP.write_text(json.dumps(expected, indent=1))
    except BuildError as err:
        print(f"[build_ggml] error: {err}", file=sys.stderr)
        return 1
    step(f"done in {time.monotonic() - started:.0f} s; libraries in {LIB_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
