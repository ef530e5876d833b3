"""bench/device_check.py --cpu --quick: the GPU check's script, proven on this machine as CI runs it.

The device run itself needs a lent GPU; this runs every step that needs none (parity against llama.cpp on
the real SmolLM2, fit == alloc, the layout loop against a simulated GPU) in a subprocess, bounded, and
reads the JSON it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.reference  # parity runs against the llama.cpp reference


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict:
    out = tmp_path_factory.mktemp("device-check")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--cpu", "--quick",
                             "--out", str(out), "--models", str(smollm2_path.parent)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert (out / "summary.md").read_text().startswith("# Device check (cpu quick)")
    return json.loads((out / "device-check.json").read_text())


def test_cpu_steps_pass(report: dict) -> None:
    steps = report["steps"]
    assert "build" not in steps  # --cpu builds nothing
    assert [steps[name]["status"] for name in ("parity", "memory", "layout")] == ["pass"] * 3
    assert report["failed"] == []


def test_gpu_only_steps_say_why_they_were_skipped(report: dict) -> None:
    for name in ("speed", "serve", "bigbatch"):
        assert report["steps"][name]["status"] == "skip"
        assert "CUDA" in report["steps"][name]["reason"]


def test_parity_measured_against_llama_cpp(report: dict) -> None:
    smollm2 = report["steps"]["parity"]["models"]["smollm2-135m-instruct"]
    assert smollm2["max_logprob_diff"] < report["steps"]["parity"]["tolerance"]
    assert smollm2["greedy_equal"] and smollm2["batched_greedy_equal"]
    assert smollm2["batched_vs_solo_diff"] < report["steps"]["parity"]["tolerance"]


def test_layout_loop_on_a_simulated_gpu(report: dict) -> None:
    cases = report["steps"]["layout"]["cases"]
    assert cases["auto"]["offloaded"] == cases["auto"]["total"]
    assert cases["partial"]["offloaded"] == 4
    too_big = cases["context_too_big"]
    assert too_big["fits"] and 0 < too_big["offloaded"] < too_big["total"]  # partial offload


def prebuilt_archive(folder: Path, arch: str, listing: str) -> Path:
    """A prebuild archive whose llama-bench lists `listing` as its devices."""
    import io
    import tarfile

    archive = folder / "cuda-build.tar.xz"
    with tarfile.open(archive, "w:xz") as out:
        for name, text, mode in (("prebuilt.json", json.dumps({"arch": arch}), 0o644),
                                 ("llama-bench", f"#!/bin/sh\nprintf '{listing}'\n", 0o755)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text), mode
            out.addfile(info, io.BytesIO(text.encode()))
    return archive


@pytest.mark.parametrize(("arch", "listing", "used"), [
    ("90", "Available devices:\\n  CUDA0: NVIDIA H200 (143000 MiB, 142000 MiB free)\\n", True),
    ("90", "Available devices:\\n", False),  # built, but no GPU it can use here
    ("80", "Available devices:\\n  CUDA0: NVIDIA H200 (143000 MiB, 142000 MiB free)\\n", False),  # another arch
])
def test_prebuilt_binaries_are_used_only_where_they_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        arch: str, listing: str, used: bool) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import device_build

    monkeypatch.setattr(device_build, "PREBUILT", prebuilt_archive(tmp_path, arch, listing))
    bin_dir = tmp_path / "device-cuda" / "bin"
    with (tmp_path / "build.log").open("w") as log:
        assert device_build.unpack_prebuilt("90", bin_dir, log) is used
    assert bin_dir.joinpath("llama-bench").exists() is used  # set aside where unused: the run builds instead
    assert "llama-bench --list-devices" in (tmp_path / "build.log").read_text()
