"""A vision model's memory: the tower's weights and its worst-case image graph as rows of their own in the runner's
report and in `plan`, per device; fit == alloc; the tower placed with the output layer, as Ollama's engine placed
it (ml/backend/ggml at 9db4bdb^: `v.*` and `mm.*` tensors on the output layer's buffer type), which the layout
loop must pay for. Gemma 3 with a synthetic tower, in Ollama's single file and as a text GGUF + mmproj; GPUs are
simulated as in tests/test_plan.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic.models import write_synthetic
from synthetic.vision import VisionSpec, add_vision, write_mmproj
from test_plan import MINIMUM

from ollama_engine.llm.load import LoadOptions
from ollama_engine.llm.plan import make_plan, plan_text
from ollama_engine.ml import BackendMemory, DeviceID, GPULayers
from ollama_engine.ml.memory import GIB, DeviceMemory, SystemInfo
from ollama_engine.models.vision import load_vision
from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.tower_memory import output_device, with_tower

SPEC = VisionSpec(n_layer=2, n_embd=64, image_size=64)
SYSTEM = SystemInfo(total_memory=64 * GIB, free_memory=32 * GIB)
OPTIONS = LoadOptions(num_ctx=256, batch_size=32, flash_attention=1)
N_LAYER = 3  # tiny-gemma3


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vision-memory")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    return {"text": text, "single": add_vision(text, folder / "vision.gguf", SPEC),
            "mmproj": write_mmproj(folder / "mmproj.gguf", SPEC)}


def opened(files: dict[str, Path], layout: str, allocate: bool):
    path, projector = (files["single"], "") if layout == "single" else (files["text"], str(files["mmproj"]))
    return open_model(str(path), LoadParams(batch_size=32, kv_size=256, num_threads=2, flash_attention=1,
                                            projector_path=projector), allocate=allocate)


@pytest.mark.parametrize("layout", ["single", "mmproj"])
def test_the_tower_has_rows_of_its_own_and_fit_equals_alloc(files, layout: str):
    """The report's output layer holds the tower's weights as Ollama's engine counted them; VisionWeights says how
    much of it is the tower and VisionGraph what its worst-case image graph takes; the CPU's graph is the larger
    of the text and the image graph. fit measures what alloc allocates, bitwise the same report."""
    fit = opened(files, layout, allocate=False)
    try:
        fitted = fit.memory.to_json()
        text, tower = fit.model.backend.memory, fit.images.tower.backend.memory
        image_graph = fit.image_graph
        assert fit.images.tower.compute_backend is fit.model.backend  # one compute buffer for both graphs
    finally:
        fit.close()
    alloc = opened(files, layout, allocate=True)
    try:
        assert alloc.memory.to_json() == fitted
        allocated = alloc.memory
        assert allocated.cpu.vision_weights == tower.input_weights + sum(tower.cpu.weights) > 0
        assert allocated.cpu.weights[-1] == text.cpu.weights[-1] + allocated.cpu.vision_weights
        assert tower.cpu.graph == 0  # the image graph has no buffer of its own: it shares the text model's
        text_only = reserved_text_graph(files, layout)
        assert allocated.cpu.vision_graph == image_graph[allocated.cpu.device_id] > 0
        assert allocated.cpu.graph == text.cpu.graph == max(text_only, allocated.cpu.vision_graph)
        assert fitted["CPU"]["VisionWeights"] == allocated.cpu.vision_weights
        assert "VisionWeights" not in BackendMemory.from_json(alloc.model.backend.memory.to_json()).cpu.to_json()
        rows = {(what, device): size for what, device, size in allocated.summary()}
        assert rows[("vision weights", "CPU")] == allocated.cpu.vision_weights
        assert rows[("model weights", "CPU")] == allocated.input_weights + sum(text.cpu.weights)
        assert rows[("total memory", "")] == allocated.input_weights + allocated.cpu.size()
    finally:
        alloc.close()


def reserved_text_graph(files: dict[str, Path], layout: str) -> int:
    """The CPU graph of the text model alone (no tower), with the same settings."""
    text = open_model(str(files["text"]), LoadParams(batch_size=32, kv_size=256, num_threads=2, flash_attention=1),
                      allocate=False)
    try:
        assert text.images is None
        return text.memory.cpu.graph
    finally:
        text.close()


def test_encoding_after_alloc_needs_no_new_memory(files):
    """The worst case was reserved at load: encoding an image and answering about it allocates nothing more."""
    import numpy as np
    from test_vision import png_bytes, smooth_image

    from ollama_engine.image import decode_image

    loaded = opened(files, "single", allocate=True)
    try:
        loaded.load()
        before = loaded.memory.to_json()
        sizes = loaded.model.backend.scheduler.buffer_sizes()  # the compute buffers as reserved at load
        out = loaded.images.tower.encode(decode_image(png_bytes(smooth_image(90, 33, seed=3))))
        assert out.shape == (16, 64) and np.isfinite(out).all()
        alone = load_vision(files["single"], num_threads=2, flash_attention=True)  # on a scheduler of its own
        try:
            alone.backend.load()
            assert np.array_equal(alone.encode(decode_image(png_bytes(smooth_image(90, 33, seed=3)))), out)
        finally:
            alone.close()
        assert loaded.memory.to_json() == before
        assert loaded.model.backend.scheduler.buffer_sizes() == sizes
        assert sizes[-1] == before["CPU"]["Graph"]  # and the report says what they are
    finally:
        loaded.close()


def test_both_layouts_cost_the_same(files):
    reports = []
    for layout in ("single", "mmproj"):
        loaded = opened(files, layout, allocate=False)
        try:
            reports.append(loaded.memory)
        finally:
            loaded.close()
    single, split = reports
    assert single.cpu.vision_weights == split.cpu.vision_weights
    assert single.cpu.vision_graph == split.cpu.vision_graph


# ------------------------------------------------------------ where the tower goes


GPU = DeviceID("GPU-0", "CUDA")


def test_the_tower_goes_with_the_output_layer():
    assert output_device([GPULayers(GPU, [0, 1, 2, 3])], block_count=3) == GPU
    assert output_device([GPULayers(GPU, [0, 1, 2])], block_count=3) is None  # output on the CPU: so is the tower
    assert output_device([], block_count=3) is None


def test_with_tower_charges_the_device_the_tower_is_on():
    """A tower placed on a GPU: its weights join that GPU's output layer and its graph that GPU's buffer; the CPU
    entry is untouched."""
    text = BackendMemory(input_weights=5, cpu=DeviceMemory(weights=[1, 0, 0], cache=[2, 0, 0], graph=50),
                         gpus=[DeviceMemory(GPU, "CUDA0", [0, 3, 4], [0, 6, 6], graph=70)])
    tower = BackendMemory(cpu=DeviceMemory(weights=[0], cache=[0], graph=0),
                          gpus=[DeviceMemory(GPU, "CUDA0", [11], [0], graph=90)])
    combined = with_tower(text, tower, {GPU: 90}, shared=True)
    assert combined.cpu == text.cpu and combined.cpu.vision_weights == 0
    assert combined.gpus[0].weights == [0, 3, 15] and combined.gpus[0].graph == 90
    assert (combined.gpus[0].vision_weights, combined.gpus[0].vision_graph) == (11, 90)
    assert text.gpus[0].weights == [0, 3, 4]  # the text model's own report is not changed
    apart = with_tower(text, tower, {GPU: 90}, shared=False)  # buffers of its own: added, not the larger
    assert apart.gpus[0].graph == 70 + 90 and apart.gpus[0].vision_graph == 90


def plan(model: Path, free: int | None, **options):
    from ollama_engine.llm.plan import parse_gpus

    gpus = parse_gpus([f"CUDA:GPU-0:{free}"]) if free is not None else []
    return make_plan(str(model), LoadOptions(**{**OPTIONS.__dict__, **options}), gpus, free is not None, SYSTEM)


def test_plan_shows_the_tower_and_places_it_with_the_output_layer(files):
    cpu = plan(files["single"], None)
    vision = cpu.memory.cpu.vision_weights
    assert vision > 0 and cpu.memory.cpu.vision_graph > 0
    text = plan_text(cpu)
    assert "image graph" in text
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("vision"))
    assert row[1] == "CPU"
    everything = plan(files["single"], 8 * GIB)  # every layer offloaded, the output layer with it: the tower too
    assert everything.layout.sum() == N_LAYER + 1
    gpu = everything.memory.gpus[0]
    assert (gpu.vision_weights, gpu.vision_graph) == (vision, cpu.memory.cpu.vision_graph)
    assert everything.memory.cpu.vision_weights == 0 and everything.memory.cpu.vision_graph == 0
    row = next(line.split() for line in plan_text(everything).splitlines() if line.strip().startswith("vision"))
    assert row[1] == "GPU-0" or row[1].startswith("CUDA")
    none = plan(files["single"], 8 * GIB, num_gpu=N_LAYER)  # the repeating layers only: the tower stays on the CPU
    assert none.layout.sum() == N_LAYER and none.memory.cpu.vision_weights == vision
    assert none.memory.gpus[0].vision_weights == 0


def test_the_layout_loop_pays_for_the_tower(files):
    """A GPU that holds the whole text model and its graph, but not the tower as well, does not get the output
    layer of the vision model: the tower's weights count in the output layer, as in Ollama's layout."""
    text = plan(files["text"], None).memory
    needed = MINIMUM + text.cpu.graph + sum(text.cpu.weights) + sum(text.cpu.cache) + 1
    assert plan(files["text"], needed).layout.sum() == N_LAYER + 1
    with_vision = plan(files["single"], needed)
    assert with_vision.layout.sum() < N_LAYER + 1
    assert with_vision.memory.cpu.vision_weights > 0  # the tower stayed on the CPU with the output layer
