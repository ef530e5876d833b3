"""`ollama-engine plan --svg`: the picture's numbers are plan --json's, bar for bar, with two simulated GPUs.

The GPUs are sized from a CPU-only plan so that the layers split three ways (some on each GPU, the rest on the
CPU): every panel then has bars and empty slots, and a bar drawn on the wrong device shows up as a mismatch.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from plan_cli import MINIMUM, N_LAYER, run, tiny_llama

from ollama_engine.llm.load import LoadOptions
from ollama_engine.llm.plan import make_plan
from ollama_engine.ml.memory import GIB, SystemInfo

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("plan-svg"))


@pytest.fixture(scope="module")
def gpus(model) -> list[str]:
    """Two simulated GPUs: the first holds two layers, the second one (the layout fills from the last layer)."""
    cpu = make_plan(str(model), LoadOptions(num_ctx=256, batch_size=32, flash_attention=1), [], False,
                    SystemInfo(total_memory=64 * GIB, free_memory=32 * GIB)).memory.cpu
    layer = cpu.weights[0] + cpu.cache[0]
    return [f"CUDA:GPU-0:{MINIMUM + cpu.graph + 2 * layer + 1}", f"CUDA:GPU-1:{MINIMUM + cpu.graph + layer + 1}"]


def test_svg_numbers_equal_the_json_plan(model, gpus, capsys, tmp_path):
    argv = [arg for gpu in gpus for arg in ("--gpu", gpu)]
    rc, out = run(model, capsys, "--json", *argv)
    assert rc == 0
    plan = json.loads(out)
    svg_path = tmp_path / "plan.svg"
    assert run(model, capsys, "--svg", str(svg_path), *argv)[0] == 0
    root = ET.parse(svg_path).getroot()
    assert root.tag == SVG + "svg"

    memory = plan["memory"]
    devices = {gpu["Name"]: gpu for gpu in memory["GPUs"]}
    assert sorted(devices) == ["CUDA0", "CUDA1"]
    offloaded = {name: [i for i, w in enumerate(gpu["Weights"]) if w] for name, gpu in devices.items()}
    assert offloaded["CUDA0"] and offloaded["CUDA1"] and any(memory["CPU"]["Weights"][:N_LAYER]), \
        f"the layers should split three ways: {plan['layout']}"
    devices["CPU"] = memory["CPU"]
    names = [str(i) for i in range(N_LAYER)] + ["output"]

    bars: dict[tuple[str, str, str], int] = {}
    for rect in root.iter(SVG + "rect"):
        if "data-kind" in rect.attrib:
            key = (rect.get("data-device"), rect.get("data-layer"), rect.get("data-kind"))
            assert key not in bars, f"two bars for {key}"
            bars[key] = int(rect.get("data-bytes"))
    expected = {}
    for name, device in devices.items():
        for i, layer in enumerate(names):
            expected[(name, layer, "weights")] = device["Weights"][i]
            expected[(name, layer, "kv_cache")] = device["Cache"][i]
        expected[(name, "graph", "graph")] = device["Graph"]
        cpu_input = memory["InputWeights"] if name == "CPU" else 0
        expected[(name, "input", "weights")] = cpu_input
        expected[(name, "input", "kv_cache")] = 0
    assert bars == expected

    panels = {g.get("data-device"): g for g in root.iter(SVG + "g") if g.get("class") == "device"}
    assert list(panels) == ["CUDA0", "CUDA1", "CPU"]
    for name, device in devices.items():
        weights = sum(device["Weights"]) + (memory["InputWeights"] if name == "CPU" else 0)
        panel = panels[name]
        assert int(panel.get("data-weights")) == weights
        assert int(panel.get("data-kv-cache")) == sum(device["Cache"])
        assert int(panel.get("data-graph")) == device["Graph"]
        assert int(panel.get("data-total")) == weights + sum(device["Cache"]) + device["Graph"]
    # the bars share one scale: the tallest is as tall as the panel
    heights = [float(r.get("height")) for r in root.iter(SVG + "rect") if r.get("data-kind")]
    assert max(heights) == pytest.approx(110.0, abs=0.1)

