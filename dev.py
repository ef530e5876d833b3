#!/usr/bin/env python3
"""Set up everything on a fresh machine, then run the demo or the tests.

    python3 dev.py demo [ARGS...]          # the main job: `ollama-engine demo ARGS...`
    python3 dev.py test [ARGS...]          # the test suite: `pytest ARGS...`
    python3 dev.py test --avx2 [ARGS...]   # the suite as on a CPU without AVX-512 (see avx2_test)

Both create .venv (once) and build ggml (a no-op when up to date). `demo` installs only what the
engine needs; `test` adds the test extra: the ollama and openai clients, and the llama.cpp reference
(llama-cpp-python), built from source once into build/reference/ with the compiler flags our ggml is
built with (build_ggml.compiler_cmake_args), so that both run the same kernels: a few minutes the first
time. Each install is redone only when pyproject.toml changes. Needs only Python 3.10+, a C/C++ compiler
and CMake.

Set-up prints one line per step; the steps' whole output goes to build/logs/*.log (on a failure, the
log's last lines and its path are shown). Steps that do not depend on each other run at the same time:
pip installs the packages while CMake compiles ggml (which needs only cffi, installed first), and for
`test` the llama.cpp reference compiles beside ggml.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import venv
from collections.abc import Sequence
from pathlib import Path

from build_ggml import BUILD, compiler_cmake_args, read_pin

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("OLLAMA_ENGINE_VENV", ROOT / ".venv"))
LOGS = BUILD / "logs"
STAMPS = {"base": ".ollama-engine-installed-base", "test": ".ollama-engine-installed"}
REFERENCE = "llama-cpp-python==0.3.36"
# An AMD EPYC of the Zen 2/3 kind, or any x86-64 CPU without AVX-512: what ggml compiles for there natively.
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]
TAIL_LINES = 60  # of a failed step's log
# progress in a log: make's "[ 45%] Building ..." or ninja's "[12/150] Building ..."
PROGRESS = re.compile(rb"^\s*\[\s*(\d+)%\]|^\s*\[(\d+)/(\d+)\]", re.M)


def say(message: str) -> None:
    print(f"[dev] {message}", file=sys.stderr, flush=True)


def seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 90 else f"{value // 60:.0f} min {value % 60:.0f} s"


def run(*args: str | Path, env: dict | None = None, cwd: Path = ROOT) -> None:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env)
    if result.returncode != 0:
        sys.exit(result.returncode)


class Step:
    """One set-up step: commands run one after another, their whole output in a log file.

    It starts once the steps it comes `after` have succeeded. `quiet_if`: a line in the log that means
    there was nothing to do (then no line is printed for the step).
    """

    def __init__(self, title: str, short: str, commands: Sequence[Sequence[str | Path]], log: Path, *,
                 cwd: Path = ROOT, env: dict | None = None, after: Sequence[Step | None] = (),
                 quiet_if: bytes | None = None):
        self.title, self.short, self.log, self.cwd, self.env = title, short, log, cwd, env
        self.commands = [[str(arg) for arg in command] for command in commands]
        self.after = [step for step in after if step is not None]
        self.quiet_if = quiet_if
        self.proc: subprocess.Popen | None = None
        self.started = self.ended = 0.0
        self.returncode: int | None = None
        self.percent: int | None = None
        self._next = 0
        self._read = 0

    def ready(self) -> bool:
        return all(step.returncode == 0 for step in self.after)

    def start(self) -> None:
        self.started = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_bytes(b"")
        self._spawn()

    def _spawn(self) -> None:
        command = self.commands[self._next]
        self._next += 1
        with self.log.open("ab") as sink:
            sink.write(f"$ {shlex.join(command)}\n".encode())
            sink.flush()
            # a session of its own: stopping the step stops what it started (pip's build subprocesses, make)
            self.proc = subprocess.Popen(command, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def poll(self) -> bool:
        """Whether the step has ended (then returncode is set)."""
        assert self.proc is not None
        code = self.proc.poll()
        if code is None:
            return False
        if code == 0 and self._next < len(self.commands):
            self._spawn()
            return False
        self.returncode, self.ended = code, time.monotonic()
        return True

    def progress(self) -> str:
        """"45%" from the last progress line in the log so far, or ""."""
        try:
            with self.log.open("rb") as f:
                f.seek(self._read)
                chunk = f.read()
        except OSError:
            return ""
        end = chunk.rfind(b"\n") + 1
        self._read += end
        for match in PROGRESS.finditer(chunk[:end]):
            done, total = (int(match[1]), 100) if match[1] else (int(match[2]), int(match[3]))
            self.percent = 100 * done // max(total, 1)
        return f"{self.percent}%" if self.percent is not None else ""

    def quiet(self) -> bool:
        return self.quiet_if is not None and self.quiet_if in self.log.read_bytes()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()


def run_steps(steps: Sequence[Step | None], report_every: float = 60.0) -> None:
    """Run the steps, each as soon as those it comes after have succeeded; one line per step.

    On a terminal a status line shows what is running (with its progress); elsewhere (CI logs) a line
    after `report_every` seconds, then after twice as long each time (1, 2, 4, 8 minutes...). A failed step
    stops the others and shows its log's last lines.
    """
    pending = [step for step in steps if step is not None]
    running: list[Step] = []
    tty = sys.stderr.isatty()
    began = time.monotonic()
    next_report = began + report_every
    status_shown = False

    def clear_status() -> None:
        nonlocal status_shown
        if status_shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
            status_shown = False

    def terminated(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        while pending or running:
            for step in [step for step in pending if step.ready()]:
                pending.remove(step)
                step.start()
                running.append(step)
            if not running:  # what is pending waits for a step that failed: cannot happen, failures exit
                raise RuntimeError(f"steps that cannot start: {[step.title for step in pending]}")
            for step in [step for step in running if step.poll()]:
                running.remove(step)
                clear_status()
                if step.returncode != 0:
                    for other in running:
                        other.stop()
                    fail(step)
                if not step.quiet():
                    say(f"{step.title} ... done in {seconds(step.ended - step.started)}")
            now = time.monotonic()
            if running and tty:
                parts = [" ".join(filter(None, (step.short, step.progress()))) for step in running]
                line = f"[dev] {' · '.join(parts)} ... {seconds(now - began)}"
                width = shutil.get_terminal_size().columns - 1
                print(f"\r\033[K{line[:width]}", end="", file=sys.stderr, flush=True)
                status_shown = True
            elif running and now >= next_report:
                next_report = began + 2 * (now - began)
                parts = [" ".join(filter(None, (step.short, step.progress()))) for step in running]
                say(f"still running after {seconds(now - began)}: {', '.join(parts)}")
            time.sleep(0.2)
    except KeyboardInterrupt:
        clear_status()
        for step in running:
            step.stop()
        say("interrupted")
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)


def fail(step: Step) -> None:
    lines = step.log.read_text(errors="replace").splitlines()
    say(f"{step.title} ... failed (exit code {step.returncode}) after {seconds(step.ended - step.started)}; "
        f"the last {min(len(lines), TAIL_LINES)} lines of its log:")
    print("\n".join(lines[-TAIL_LINES:]), file=sys.stderr)
    say(f"the whole log: {step.log}")
    sys.exit(step.returncode or 1)


def requirement(name: str, extra: str | None = None) -> list[str]:
    """pyproject.toml's requirements on `name` (in `extra`'s list, or the dependencies), as written there."""
    text = (ROOT / "pyproject.toml").read_text()
    listing = re.search(rf"^{extra} = \[(.*?)\]" if extra else r"^dependencies = \[(.*?)\]", text, re.M | re.S)
    found = re.findall(r'"([^"]+)"', listing[1]) if listing else []
    return [spec for spec in found if re.split(r"[<>=!~\[ ;]", spec)[0].lower() == name] if name else found


def create_venv(venv_dir: Path) -> None:
    started = time.monotonic()
    venv.EnvBuilder(with_pip=True).create(venv_dir)
    say(f"creating the virtual environment {venv_dir} ... done in {seconds(time.monotonic() - started)}")


def setup(extra: str, venv_dir: Path = VENV, root: Path = ROOT, logs: Path = LOGS,
          ggml_args: Sequence[str] = (), wheels: Path | None = None, reference_flags: Sequence[str] = ()) -> None:
    """The venv with the package installed (`base`: the engine alone; `test`: plus the test extra), and ggml.

    Steps: cffi first (build_ggml.py needs only cffi), then at the same time the packages' install and the ggml
    build; for `test` also the download of the ggml source (from the start) and, once it is there, the llama.cpp
    reference's build into `wheels` beside the ggml build; then the reference's install.
    """
    python = venv_dir / "bin" / "python"
    pip = [python, "-m", "pip"]
    if not python.exists():
        create_venv(venv_dir)
    wanted = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()
    # a test install includes the base one
    stamps = [venv_dir / STAMPS[name] for name in (["test"] if extra == "test" else ["base", "test"])]
    stale = not any(stamp.exists() and stamp.read_text() == wanted for stamp in stamps)
    boot = fetch = reference = packages = final = None
    if stale:
        # cffi as the engine requires it (so that the install below keeps it as it is), and setuptools, which cffi
        # compiles with (a venv of Python 3.12+ has none). pip itself is not upgraded: the downloads below run the
        # venv's pip at the same time, and any pip since 21.3 installs this project.
        cffi = requirement("cffi") or ["cffi"]
        boot = Step("installing cffi (all that build_ggml.py needs)", "cffi",
                    [[*pip, "install", "--progress-bar", "off", *cffi, "setuptools"]], logs / "pip-bootstrap.log")
    if extra == "test" and stale:
        wheels = wheels or BUILD / "reference"
        if not list(wheels.glob("llama_cpp_python-*.whl")):
            fetch = Step("downloading the ggml source (llama-cpp-python's source distribution)", "download",
                         [[python, ROOT / "build_ggml.py", "--fetch-only"]], logs / "fetch.log",
                         quiet_if=b"[build_ggml] up to date")
            sdist = BUILD / read_pin()["sdist"]
            # from the source distribution build_ggml.py verified, with our compiler flags; not through pip's
            # wheel cache: it may hold a build made with other flags (e.g. -march=native alone)
            env = {**os.environ, "CMAKE_ARGS": shlex.join([*reference_flags, *compiler_cmake_args()])}
            reference = Step(f"building the llama.cpp reference ({REFERENCE}) from source into {wheels}",
                             "reference", [[*pip, "wheel", "-v", "--progress-bar", "off", "--no-deps",
                                            "--no-cache-dir", sdist, "-w", wheels]],
                             logs / "reference.log", env=env, after=[fetch])
    ggml = Step("building ggml and its cffi bindings", "ggml", [[python, root / "build_ggml.py", *ggml_args]],
                logs / "ggml.log",
                cwd=root, after=[boot, fetch], quiet_if=b"[build_ggml] up to date")
    if stale and extra == "test":
        others = [spec for spec in requirement("", "test") if not spec.lower().startswith("llama-cpp-python")]
        packages = Step("installing the engine's and the tests' packages", "packages",
                        [[*pip, "install", "--progress-bar", "off", "-e", root, *others]], logs / "pip.log",
                        after=[boot])
        assert wheels is not None
        final = Step("installing the llama.cpp reference", "reference install",
                     [[*pip, "install", "--progress-bar", "off", "--find-links", wheels, REFERENCE],
                      # a venv made before may hold the same version built with other flags
                      [*pip, "install", "--progress-bar", "off", "--no-deps", "--force-reinstall", "--no-index",
                       "--find-links", wheels, REFERENCE]],
                     logs / "pip-reference.log", after=[packages, reference])
    elif stale:
        packages = Step("installing the engine's packages", "packages",
                        [[*pip, "install", "--progress-bar", "off", "-e", root]], logs / "pip.log", after=[boot])
    run_steps([boot, fetch, reference, ggml, packages, final])
    if stale:
        (venv_dir / STAMPS[extra]).write_text(wanted)


def _remove_stale(tree: Path, listed: set[str]) -> int:
    """Delete the copy's files that the working tree no longer has (a module deleted or moved would otherwise
    stay importable there); files git ignores (builds, caches) stay."""
    tops = {name.split("/", 1)[0] for name in listed}
    candidates = [str(path.relative_to(tree)) for top in tops if (tree / top).is_dir()
                  for path in (tree / top).rglob("*") if path.is_file()]
    candidates = [name for name in candidates if name not in listed]
    if not candidates:
        return 0
    check = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(candidates),
                           capture_output=True, text=True)
    ignored = set(check.stdout.split("\n"))
    stale = [name for name in candidates if name not in ignored]
    for name in stale:
        (tree / name).unlink()
    return len(stale)


def avx2_test(pytest_args: list[str]) -> None:
    """Run the suite as an AVX2-only CPU would, on any x86-64 machine.

    ggml's kernels (and so its rounding) differ between CPU families. Both our ggml and the llama.cpp
    reference are compiled for AVX2 without AVX-512, into build/avx2/: a copy of the working tree
    (tracked files and untracked ones git does not ignore), its own venv, ggml build and reference wheel.
    The first run compiles both: about 10 minutes on 2 cores.
    """
    home = ROOT / "build" / "avx2"
    tree, venv_dir = home / "tree", home / "venv"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    copied = 0
    for name in filter(None, listed):
        source, target = ROOT / name, tree / name
        if source.is_file() and (not target.exists() or target.read_bytes() != source.read_bytes()):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            copied += 1
    removed = _remove_stale(tree, {name for name in listed if name})
    if copied or removed:
        say(f"working tree copied to {tree} ({copied} files changed, {removed} removed)")
    pin = read_pin()
    # the sources the default build downloads (the download step below fetches them when missing)
    source = BUILD / "src" / pin["llama_cpp_dir"]
    build_args = [f"--cmake-arg={flag}" for flag in AVX2_FLAGS if flag != "-DGGML_NATIVE=OFF"]
    build_args += ["--portable", "--source", str(source)]
    if not source.joinpath("ggml", "include", "ggml.h").exists():
        python = venv_dir / "bin" / "python"
        if not python.exists():
            create_venv(venv_dir)
        run_steps([Step("downloading the ggml source (llama-cpp-python's source distribution)", "download",
                        [[python, ROOT / "build_ggml.py", "--fetch-only"]], home / "logs" / "fetch.log",
                        quiet_if=b"[build_ggml] up to date")])
    setup("test", venv_dir, tree, home / "logs", build_args, home / "wheels", AVX2_FLAGS)
    python = venv_dir / "bin" / "python"
    check = ("from ollama_engine.ggml import lib; import llama_cpp; "
             "info = llama_cpp.llama_print_system_info().decode(); "
             "assert lib.ggml_cpu_has_avx2() and not lib.ggml_cpu_has_avx512() and 'AVX512 = 1' not in info, info")
    run(python, "-c", check, cwd=tree)
    say("ggml and the llama.cpp reference run AVX2 kernels, no AVX-512")
    sys.exit(subprocess.run([str(python), "-m", "pytest", *pytest_args], cwd=tree).returncode)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        sys.exit(2)
    command, rest = argv[0], argv[1:]
    if command == "test" and rest[:1] == ["--avx2"]:
        avx2_test(rest[1:])
    setup("base" if command == "demo" else "test")
    python = VENV / "bin" / "python"
    if command == "demo":
        run(python, "-m", "ollama_engine", "demo", *rest)
    else:
        run(python, "-m", "pytest", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
