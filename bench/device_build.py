"""What travels to a lent GPU machine and how ggml, libllama and llama.cpp's tools are built there (or here,
for there): the first half of bench/device_check.py, which runs the steps.

    python bench/device_check.py pack       # here: .device-check/ (carried): source or headers, wheels, a model
    python bench/device_check.py prebuild   # here, with nvcc and cuBLAS: the CUDA build, packed for there
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PACK = ROOT / ".device-check"  # what `pack` writes here and the device run reads there
DEVICE_BUILD = ROOT / "build" / "device-cuda"
PREBUILT = PACK / "cuda-build.tar.xz"  # `prebuild`'s binaries, used there in place of a build where they run
BUILD_TARGETS = ("ggml", "llama", "llama-bench", "llama-server", "llama-fit-params")
SOURCE_PARTS = ("CMakeLists.txt", "cmake", "common", "ggml", "include", "src", "tools", "vendor", "licenses", "app",
                "LICENSE", "build-xcframework.sh",
                "models/ggml-vocab-llama-bpe.gguf")  # the synthetic 8B model's vocabulary (tests/synthetic)
TRAVEL_LIMIT = 64 << 20  # the device tool's working tree, carried paths included
HEADER_PARTS = ("ggml/include", "ggml/src", "models/ggml-vocab-llama-bpe.gguf")
WHEELS = ("cffi==2.1.1", "pycparser==3.12", "gguf==0.19.0", "llguidance==1.9.1", "diskcache==5.6.3",  # as in .venv
          "py-spy==0.4.3")  # the serve step's profiler
BUILD_SECONDS = 300


def log(message: str) -> None:
    print(f"[device-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)



def run_bounded(command: list[str], seconds: float, log_file: Any) -> int:
    """Run command in its own process group, output to log_file; past `seconds` the whole group is killed
    (a step's servers and a build's compilers with it) and TimeoutExpired raised."""
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        return process.wait(timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    finally:  # whatever the step left running (a server whose parent died) goes with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


# ---------------------------------------------------------------- pack (here)


def llama_tree() -> Path:
    """The pinned llama.cpp tree build_ggml.py extracted under build/src (fetching it if needed)."""
    import build_ggml

    return build_ggml.fetch_source(build_ggml.read_pin())


def truncated_name(layers: int) -> str:
    return f"SmolLM2-135M-Instruct.Q4_1.first-{layers}-layers.gguf"


def truncate_gguf(source: Path, target: Path, blocks: int) -> None:
    """The GGUF with only its first `blocks` layers: real weights (embeddings, output, layers) small enough to
    travel (SmolLM2 whole is 98 MB; its 30 MB of embeddings and 2 layers are 35 MB)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = blocks if key == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if not (tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= blocks):
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def real_model_folder(explicit: Path | None) -> Path:
    from ollama_engine.fs.real_models import cache_dir

    return explicit or cache_dir()


def pack(wheels: bool, real_layers: int) -> int:
    """Write .device-check/: the pruned source, the llama_cpp bindings and the wheels; print its size."""
    tree = llama_tree()
    PACK.mkdir(exist_ok=True)
    exclude = ROOT / ".git" / "info" / "exclude"  # ignored, so it travels only where `carry` names it
    exclude.parent.mkdir(exist_ok=True)
    if not exclude.exists() or "/.device-check/" not in exclude.read_text():
        with exclude.open("a") as out:
            out.write("/.device-check/\n")
    # with `prebuild`'s binaries packed, the run there compiles only our bindings: ggml's headers will do
    parts = HEADER_PARTS if PREBUILT.exists() else SOURCE_PARTS
    log(f"packing the llama.cpp {'headers' if PREBUILT.exists() else 'source'} the run needs")
    with tarfile.open(PACK / "llama-src.tar.gz", "w:gz") as archive:
        for part in parts:
            if (tree / part).exists():
                archive.add(tree / part, arcname=f"llama.cpp/{part}", filter=lambda info: None if (
                    "/webui/node_modules" in info.name or parts is HEADER_PARTS and info.isfile()
                    and not info.name.endswith((".h", ".gguf"))) else info)
    bindings = tree.parents[1] / "llama_cpp"
    shutil.rmtree(PACK / "llama_cpp", ignore_errors=True)
    shutil.copytree(bindings, PACK / "llama_cpp", ignore=shutil.ignore_patterns("lib", "__pycache__", "*.so"))
    if wheels:
        (PACK / "wheels").mkdir(exist_ok=True)
        platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)] + [
            "--platform=manylinux2014_x86_64"]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms,
                        "-d", str(PACK / "wheels"), *WHEELS], check=True)
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            text=True).stdout.split("\0")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())
    shutil.rmtree(PACK / "models", ignore_errors=True)
    smollm2 = real_model_folder(None) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if real_layers and smollm2.exists():
        (PACK / "models").mkdir()
        cut = PACK / "models" / truncated_name(real_layers)
        truncate_gguf(smollm2, cut, real_layers)
        if tree + sum(f.stat().st_size for f in PACK.rglob("*") if f.is_file()) > TRAVEL_LIMIT:
            log(f"{cut.name} left out: it would not fit beside the rest (stories260K, in the tree, has real "
                "weights too)")
            shutil.rmtree(PACK / "models")
    size = sum(f.stat().st_size for f in PACK.rglob("*") if f.is_file())
    print(json.dumps({"pack": str(PACK), "bytes": size, "tree_bytes": tree, "travels": size + tree,
                      "limit": TRAVEL_LIMIT}))
    return 0


SITECUSTOMIZE = """\
import importlib.abc, importlib.util, sys

MAPPING = {}


class _EngineFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in MAPPING:
            return importlib.util.spec_from_file_location(
                name, MAPPING[name] + "/__init__.py", submodule_search_locations=[MAPPING[name]])
        return None


sys.meta_path.insert(0, _EngineFinder())
"""


def install_pack() -> None:
    """There: the carried wheels into a site folder, and the llama_cpp bindings, on this process's path."""
    site = Path("/tmp/device-check-site")
    wheels = sorted((PACK / "wheels").glob("*.whl"))
    if wheels and not site.joinpath("cffi").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], check=True)
    # the engine's packages as the editable install maps them (pyproject's package-dir), without installing it
    mapping = {f"ollama_engine.{name}": str(ROOT / name) for name in ("models", "kvcache", "server")}
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.replace("MAPPING = {}", f"MAPPING = {mapping!r}"))
    if not any(type(finder).__name__ == "_EngineFinder" for finder in sys.meta_path):  # this process started
        runpy.run_path(str(site / "sitecustomize.py"))  # before the file existed: its finder here too
    paths = [str(site), str(PACK)]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [str(ROOT), os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = paths


# ---------------------------------------------------------------- build (there)


def cuda_arch() -> str:
    """The visible GPU's compute capability as nvidia-smi reports it, e.g. '90' for an H100: one architecture."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0].replace(".", "")


def source_tree() -> Path:
    """build/src's tree where it exists (here), else the carried pruned tarball unpacked (there)."""
    import build_ggml

    tree = build_ggml.BUILD / "src" / build_ggml.read_pin()["llama_cpp_dir"]
    if tree.joinpath("ggml", "include", "ggml.h").exists():
        return tree
    tarball = PACK / "llama-src.tar.gz"
    if not tarball.exists():
        raise RuntimeError(f"no llama.cpp source: run `python bench/device_check.py pack` here and carry {PACK.name}")
    target = Path("/tmp/device-check-src")
    if not target.joinpath("llama.cpp").exists():
        with tarfile.open(tarball) as archive:
            archive.extractall(target, filter="data")
    os.environ["OLLAMA_ENGINE_LLAMA_CPP"] = str(target / "llama.cpp")  # where the synthetic models find vocabularies
    return target / "llama.cpp"


def cmake_options(arch: str, portable: bool) -> list[str]:
    """The device build's configuration: ggml with CUDA for one architecture, libllama and the two tools.
    portable: CPU code any x86-64 with AVX2 runs (binaries made here for another machine), else this CPU's."""
    import build_ggml

    cpu = ["-DGGML_NATIVE=OFF", *(f"-DGGML_{ext}=ON" for ext in ("AVX", "AVX2", "FMA", "F16C", "BMI2"))] \
        if portable else ["-DGGML_NATIVE=ON"]
    return ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", *cpu, "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_CUDA_NCCL=OFF", "-DGGML_RPC=OFF", "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_COMMON=ON", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
            "-DCMAKE_INSTALL_RPATH=$ORIGIN", *build_ggml.compiler_cmake_args()]


def cmake_build(tree: Path, build_dir: Path, options: list[str], jobs: int, seconds: float, log_file: Any) -> None:
    """Configure and build BUILD_TARGETS, the whole within `seconds` (TimeoutExpired past them)."""
    started = time.monotonic()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for command in (["cmake", "-S", str(tree), "-B", str(build_dir), *generator, *options],
                    ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *BUILD_TARGETS]):
        if run_bounded(command, seconds - (time.monotonic() - started), log_file) != 0:
            raise RuntimeError(f"{' '.join(command[:3])} failed: see the build log")


def prebuild(arch: str, jobs: int) -> int:
    """Here, where nvcc and cuBLAS are installed but no GPU is: the device build with portable CPU code, its
    binaries packed into .device-check/ so that a device run spends no device time compiling (the build is
    ~75 CPU-minutes: 144 CUDA files at 10-60 s each, beyond 300 s on 16 cores)."""
    toolkit = Path(shutil.which("nvcc") or "nvcc").resolve().parents[1]
    build_dir = ROOT / "build" / "device-cuda-portable"
    options = cmake_options(arch, portable=True)
    stub = toolkit / "lib64" / "stubs" / "libcuda.so"
    if not stub.exists():  # no driver nor its stub here: an empty libcuda.so.1 to link against, whose
        # symbols the GPU machine's driver defines at run time
        stub = build_dir / "libcuda-stub" / "libcuda.so"
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.with_suffix(".c").write_text("")
        subprocess.run(["cc", "-shared", "-o", str(stub), "-Wl,-soname,libcuda.so.1", str(stub.with_suffix(".c"))],
                       check=True)
        # --no-as-needed: the stub defines nothing, so the linker would otherwise drop libcuda.so.1 from
        # libggml-cuda's needs, and its driver calls would find no symbol there ("undefined symbol: cuDeviceGet")
        options += [f"-DCUDA_cuda_driver_LIBRARY={stub}", "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined",
                    "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--no-as-needed"]
    log(f"building for sm_{arch} on {jobs} cores (log: {build_dir / 'build.log'})")
    build_dir.mkdir(parents=True, exist_ok=True)
    with (build_dir / "build.log").open("a") as out:
        cmake_build(llama_tree(), build_dir, options, jobs, 6 * 3600, out)
    return pack_prebuilt(build_dir / "bin", arch, options)


def pack_prebuilt(bin_dir: Path, arch: str, options: list[str]) -> int:
    """The libraries and the two tools of a finished device build, into .device-check/ (xz: ~1/4 the size)."""
    PACK.mkdir(exist_ok=True)
    (bin_dir / "prebuilt.json").write_text(json.dumps({"arch": arch, "options": options}))
    with tarfile.open(PREBUILT, "w:xz") as archive:
        for path in sorted(bin_dir.iterdir()):
            if path.name.startswith("lib") or path.name in (*BUILD_TARGETS, "prebuilt.json"):
                archive.add(path, arcname=path.name)
    print(json.dumps({"prebuilt": str(PREBUILT), "bytes": PREBUILT.stat().st_size}))
    return 0


def unpack_prebuilt(arch: str, bin_dir: Path, log_file: Any) -> bool:
    """`prebuild`'s binaries into bin_dir where they are for this GPU and run here (llama-bench lists the
    GPU); False, with bin_dir removed, where not (then the run builds)."""
    if not PREBUILT.exists():
        return False
    shutil.rmtree(bin_dir.parent, ignore_errors=True)
    bin_dir.mkdir(parents=True)
    with tarfile.open(PREBUILT) as archive:
        archive.extractall(bin_dir, filter="data")
    built_for = json.loads((bin_dir / "prebuilt.json").read_text())["arch"]
    listed = subprocess.run([str(bin_dir / "llama-bench"), "--list-devices"], capture_output=True, text=True,
                            timeout=60)
    log_file.write(f"prebuilt for sm_{built_for}; llama-bench --list-devices: {listed.stdout}{listed.stderr}\n")
    if built_for == arch and listed.returncode == 0 and "CUDA0" in listed.stdout:
        return True
    shutil.rmtree(bin_dir.parent, ignore_errors=True)
    return False


def build(tree: Path, jobs: int, log_path: Path, seconds: float) -> dict[str, Any]:
    """ggml (CUDA), libllama, llama-bench and llama-server in one tree (or `prebuild`'s, where they run);
    our bindings against its ggml."""
    import build_ggml

    arch, started = cuda_arch(), time.monotonic()
    bin_dir = DEVICE_BUILD / "bin"
    with log_path.open("a") as out:
        prebuilt = unpack_prebuilt(arch, bin_dir, out)
        if not prebuilt and not tree.joinpath("CMakeLists.txt").exists():
            raise RuntimeError("prebuild's binaries did not run here (build.log says why) and only ggml's headers "
                               "travelled: remove .device-check/cuda-build.tar.xz, pack again, carry the source")
        if not prebuilt:
            cmake_build(tree, DEVICE_BUILD, cmake_options(arch, portable=False), jobs, seconds, out)
    shutil.rmtree(build_ggml.LIB_DIR, ignore_errors=True)
    build_ggml.LIB_DIR.mkdir(parents=True)
    built = sorted(bin_dir.glob("libggml*.so*"))
    for lib in built:
        shutil.copy2(lib, build_ggml.LIB_DIR / lib.name, follow_symlinks=False)
    build_ggml.compile_bindings(tree, sorted({lib.name[3:].split(".so")[0] for lib in built}))
    os.environ["LLAMA_CPP_LIB_PATH"] = str(bin_dir)  # the reference's libllama, on the same ggml
    return {"arch": arch, "prebuilt": prebuilt, "seconds": round(time.monotonic() - started, 1),
            "targets": list(BUILD_TARGETS)}


def cuda_library_dirs() -> list[str]:
    """Folders holding the CUDA runtime and cuBLAS libraries of the toolkit's major version (the one the build
    links), where the loader's cache lacks them: an image may keep them in the toolkit's folder or in
    Python's nvidia-* packages."""
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout if shutil.which("nvcc") else ""
    major = nvcc.split("release ")[1].split(".")[0] if "release " in nvcc else ""
    cached = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    found: list[str] = []
    patterns = ["/usr/local/cuda*/lib64", "/usr/local/cuda*/targets/*/lib",
                *(f"{site}/nvidia/*/lib" for site in sys.path if site.endswith("-packages"))]
    for library in (f"libcudart.so.{major}", f"libcublas.so.{major}", f"libcublasLt.so.{major}"):
        if library in cached:
            continue
        for folder in sorted({f for p in patterns for f in glob.glob(p)}):
            if glob.glob(f"{folder}/{library}*"):
                found += [folder] if folder not in found else []
                break
    return found
