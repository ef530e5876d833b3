"""`ollama-engine plan`: what a model would take on this machine, layer by layer, without allocating anything.

The real load loop (`load.load`) runs against a dry-run target that answers every /load operation with a fit
measured in this process, so the layout it settles on is the one a runner would be given. GPUs are the ones
ggml sees, or simulated ones given as `--gpu LIBRARY:ID:FREE`. A simulated GPU cannot measure anything, so the
model is fitted on the CPU and each layer's measured weights and KV cache are charged to the GPU the layout puts
it on; a GPU holding layers is charged a compute graph as large as the measured CPU graph.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ollama_engine.ml import gpu_devices
from ollama_engine.ml.memory import (
    BackendMemory,
    DeviceID,
    DeviceInfo,
    DeviceMemory,
    GPULayersList,
    SystemInfo,
    human_bytes2,
    resolve_flash_attention,
)
from ollama_engine.runner.allocate import open_model
from ollama_engine.server.wire import LoadOperation, LoadRequest

from .discovery import system_info
from .layout import InsufficientSystemMemoryError, LoadRequiredFullError
from .load import Attempt, LoadError, LoadOptions, load
from .memory_svg import memory_svg

SIMULATED_NOTE = (
    "simulated GPUs: per-layer weights and KV cache were measured on the CPU and charged to the GPU the layout "
    "puts each layer on (a vision tower goes with the output layer); a GPU holding layers is charged a compute "
    "graph equal to the measured CPU graph"
)

_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")


def parse_size(text: str) -> int:
    """Bytes from "1000000", "512MiB", "8GiB" or "1.5GB" (binary and decimal units, any case)."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"bad size {text!r}: want bytes, or a number with a unit such as 512MiB or 8GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_gpus(specs: Sequence[str]) -> list[DeviceInfo]:
    """Simulated GPUs from LIBRARY:ID:FREE strings; the ID may itself hold colons (a PCI bus id).

    Each is named as ggml would name it: the library and the GPU's ordinal within it (CUDA0, CUDA1, ...).
    """
    gpus: list[DeviceInfo] = []
    for spec in specs:
        library, _, rest = spec.partition(":")
        device, _, free = rest.rpartition(":")
        if not library or not device or not free:
            raise ValueError(f"bad --gpu {spec!r}: want LIBRARY:ID:FREE, e.g. CUDA:GPU-0:8GiB")
        try:
            free_memory = parse_size(free)
        except ValueError as err:
            raise ValueError(f"bad --gpu {spec!r}: {err}") from None
        device_id = DeviceID(device, library)
        if any(gpu.device_id == device_id for gpu in gpus):
            raise ValueError(f"bad --gpu {spec!r}: GPU {library}:{device} is given twice")
        ordinal = sum(gpu.device_id.library == library for gpu in gpus)
        gpus.append(DeviceInfo(device_id=device_id, name=f"{library}{ordinal}", total_memory=free_memory,
                               free_memory=free_memory))
    return gpus


def present_gpus() -> list[DeviceInfo]:
    """The GPUs ggml sees in this process, as a runner's /info would report them."""
    return [
        DeviceInfo(device_id=gpu.device_id, name=gpu.name, description=gpu.description,
                   integrated=gpu.kind == "IGPU", total_memory=gpu.total_memory, free_memory=gpu.free_memory())
        for gpu in gpu_devices()
    ]


class _DryRun:
    """A load target that measures every request as a fit: nothing is allocated, so every operation succeeds."""

    def __init__(self, model: str, simulated: Sequence[DeviceInfo]) -> None:
        self.model = model
        self.simulated = list(simulated)
        self._cpu_fit: BackendMemory | None = None
        self.last = (GPULayersList(), BackendMemory())

    def load(self, request: dict[str, Any]) -> tuple[bool, BackendMemory]:
        if request["Operation"] == LoadOperation.CLOSE:
            return False, BackendMemory()
        layout = GPULayersList.from_json(request["GPULayers"])
        if self.simulated:
            memory = self._attribute(self._measure({**request, "GPULayers": None}), layout)
        else:
            memory = self._measure(request)
        self.last = layout, memory
        return True, memory

    def _measure(self, request: dict[str, Any]) -> BackendMemory:
        """What the runner would report: the request goes through the runner's own decoding."""
        if self.simulated and self._cpu_fit is not None:
            return self._cpu_fit  # without real GPUs the layout cannot change what the CPU measures
        loaded = open_model(self.model, LoadRequest.from_json(json.dumps(request).encode()).params(), allocate=False)
        try:
            memory = copy.deepcopy(loaded.memory)
        finally:
            loaded.close()
        if self.simulated:
            self._cpu_fit = memory
        return memory

    def _attribute(self, cpu_fit: BackendMemory, layout: GPULayersList) -> BackendMemory:
        """Move the measured size of each layer the layout offloads from the CPU to its simulated GPU."""
        memory = copy.deepcopy(cpu_fit)
        total_layers = len(memory.cpu.weights)
        for gpu in self.simulated:
            entry = DeviceMemory(gpu.device_id, gpu.name, [0] * total_layers, [0] * total_layers)
            for layer in (i for placed in layout if placed.device_id == gpu.device_id for i in placed.layers):
                entry.weights[layer], memory.cpu.weights[layer] = memory.cpu.weights[layer], 0
                entry.cache[layer], memory.cpu.cache[layer] = memory.cpu.cache[layer], 0
                if layer == total_layers - 1:  # the tower is the output layer's (runner/tower_memory.py)
                    entry.vision_weights, memory.cpu.vision_weights = memory.cpu.vision_weights, 0
                    entry.vision_graph, memory.cpu.vision_graph = memory.cpu.vision_graph, 0
            entry.graph = memory.cpu.graph if any(entry.weights) or any(entry.cache) else 0
            memory.gpus.append(entry)
        return memory


@dataclass
class Plan:
    """The outcome of the layout loop: the layout it chose (or last tried) and what that layout costs."""

    model: str
    options: LoadOptions
    system: SystemInfo
    gpus: list[DeviceInfo]
    simulated: bool
    layout: GPULayersList
    memory: BackendMemory
    error: str | None = None
    passes: list[GPULayersList] = field(default_factory=list)  # the layouts fitted, in order

    @property
    def fits(self) -> bool:
        """The loop found a layout this machine can hold (possibly with some or all layers on the CPU)."""
        return self.error is None

    @property
    def total_layers(self) -> int:
        return len(self.memory.cpu.weights)

    def layer_size(self, layer: int) -> int:
        return sum(d.weights[layer] + d.cache[layer] for d in [self.memory.cpu, *self.memory.gpus])

    def device_of(self, layer: int) -> str:
        for entry in self.layout:
            if layer in entry.layers:
                return next((g.name for g in self.gpus if g.device_id == entry.device_id), entry.device_id.id)
        return self.memory.cpu.name or "CPU"


def make_plan(model: str, options: LoadOptions, gpus: Sequence[DeviceInfo], simulated: bool,
              system: SystemInfo) -> Plan:
    """Run the load loop against measurements only; a loop that gives up is reported in `error`."""
    target = _DryRun(model, gpus if simulated else [])
    total_layers = len(target.load(options.request(LoadOperation.FIT, GPULayersList()))[1].cpu.weights)
    passes: list[GPULayersList] = []

    def on_attempt(attempt: Attempt) -> None:
        if attempt.operation == LoadOperation.FIT:
            passes.append(attempt.gpu_layers)

    try:
        result = load(target, system, gpus, total_layers, options, on_attempt=on_attempt)
    except (LoadError, LoadRequiredFullError, InsufficientSystemMemoryError) as err:
        layout, memory = target.last
        return Plan(model, options, system, list(gpus), simulated, layout, memory, str(err), passes)
    return Plan(model, options, system, list(gpus), simulated, result.gpu_layers, result.memory, None, passes)


# ---------------------------------------------------------------- rendering


def plan_json(plan: Plan) -> dict[str, Any]:
    """One object: "memory" and "layout" exactly as /load returns and takes them."""
    return {
        "model": plan.model,
        "memory": plan.memory.to_json(),
        "layout": plan.layout.to_json(),
        "gpus": [
            {**gpu.device_id.to_json(), "name": gpu.name, "free_memory": gpu.free_memory, "simulated": plan.simulated}
            for gpu in plan.gpus
        ],
        "system": plan.system.to_json(),
        "flash_attention": {"enabled": plan.options.flash_attention == 1,
                            "reason": plan.options.flash_attention_reason},
        "fits": plan.fits,
        "error": plan.error,
        "offloaded_layers": plan.layout.sum(),
        "total_layers": plan.total_layers,
        "passes": [layout.to_json() for layout in plan.passes],
        "why": _why(plan),
    }


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Aligned columns, two spaces apart; the columns in `right` are right-aligned (numbers)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _layer_name(plan: Plan, layer: int) -> str:
    return "output" if layer == plan.total_layers - 1 else str(layer)


def _layer_span(layers: Sequence[int], plan: Plan) -> str:
    if not layers:
        return "0"
    names = [_layer_name(plan, i) for i in sorted(layers)]
    return f"{len(layers)} ({names[0]}..{names[-1]})" if len(names) > 1 else f"1 ({names[0]})"


def _layer_rows(plan: Plan) -> list[list[str]]:
    memory = plan.memory
    rows = [["input", memory.cpu.name or "CPU", human_bytes2(memory.input_weights), "-",
             human_bytes2(memory.input_weights)]]
    vision = sum(d.vision_weights for d in [memory.cpu, *memory.gpus])
    for i in range(plan.total_layers):
        weights = sum(d.weights[i] for d in [memory.cpu, *memory.gpus]) - (vision if i == plan.total_layers - 1 else 0)
        cache = sum(d.cache[i] for d in [memory.cpu, *memory.gpus])
        rows.append([_layer_name(plan, i), plan.device_of(i), human_bytes2(weights), human_bytes2(cache),
                     human_bytes2(weights + cache)])
    if vision:  # a row of its own, on the output layer's device, as Ollama's engine placed a tower
        rows.append(["vision", plan.device_of(plan.total_layers - 1), human_bytes2(vision), "-", human_bytes2(vision)])
    return rows


def _device_rows(plan: Plan) -> list[list[str]]:
    memory = plan.memory
    rows = []
    for gpu in plan.gpus:
        reported = next((m for m in memory.gpus if m.device_id == gpu.device_id), DeviceMemory())
        layers = [i for entry in plan.layout if entry.device_id == gpu.device_id for i in entry.layers]
        rows.append([gpu.name, _layer_span(layers, plan), human_bytes2(sum(reported.weights)),
                     human_bytes2(sum(reported.cache)), human_bytes2(reported.graph), _image_graph(reported),
                     human_bytes2(reported.size()), human_bytes2(gpu.free_memory)])
    offloaded = {i for entry in plan.layout for i in entry.layers}
    cpu = memory.cpu
    rows.append([cpu.name or "CPU", _layer_span([i for i in range(plan.total_layers) if i not in offloaded], plan),
                 human_bytes2(memory.input_weights + sum(cpu.weights)), human_bytes2(sum(cpu.cache)),
                 human_bytes2(cpu.graph), _image_graph(cpu), human_bytes2(memory.input_weights + cpu.size()),
                 human_bytes2(plan.system.free_memory)])
    return rows


def _image_graph(device: DeviceMemory) -> str:
    """A vision tower's worst-case image graph on the device: the graph column is the larger of it and the text's."""
    return human_bytes2(device.vision_graph) if device.vision_graph else "-"


def _why(plan: Plan) -> list[str]:
    """Why the layers left on the CPU are not on a GPU, in the terms the layout planner uses."""
    on_cpu = plan.total_layers - plan.layout.sum()
    if on_cpu == 0:
        return ["every layer is on a GPU"]
    if not plan.gpus:
        return [f"no GPU: all {plan.total_layers} layers stay on the CPU"]
    lines = []
    if 0 <= plan.options.num_gpu < plan.total_layers:
        lines.append(f"--num-gpu {plan.options.num_gpu} asks for at most {plan.options.num_gpu} layers on GPUs")
    offloaded = {i for entry in plan.layout for i in entry.layers}
    smallest = min(plan.layer_size(i) for i in range(plan.total_layers) if i not in offloaded)
    graph_estimate = plan.memory.cpu.graph
    for gpu in plan.gpus:
        reported = next((m for m in plan.memory.gpus if m.device_id == gpu.device_id), None)
        if reported is None:
            lines.append(f"{gpu.name}: the runner does not see this GPU")
            continue
        graph = reported.graph or graph_estimate
        reserved = gpu.minimum_memory() + plan.options.gpu_overhead + graph
        room = max(gpu.free_memory - reserved, 0)
        used = sum(reported.weights) + sum(reported.cache)
        text = (f"{gpu.name}: {human_bytes2(gpu.free_memory)} free - {human_bytes2(gpu.minimum_memory())} minimum "
                f"reserve - {human_bytes2(graph)} graph")
        if plan.options.gpu_overhead:
            text += f" - {human_bytes2(plan.options.gpu_overhead)} overhead"
        text += f" = {human_bytes2(room)} for layers; holds {human_bytes2(used)}"
        if room - used < smallest:
            text += f", the smallest layer left on the CPU needs {human_bytes2(smallest)}"
        lines.append(text)
    lines.append(f"{on_cpu} of {plan.total_layers} layers stay on the CPU")
    return lines


def _cache_types(options: LoadOptions) -> str:
    key = options.kv_cache_type_k or options.kv_cache_type or "f16"
    value = options.kv_cache_type_v or options.kv_cache_type or "f16"
    return key if key == value else f"K {key} / V {value}"


def plan_text(plan: Plan) -> str:
    options = plan.options
    total, vram = plan.memory.memory_size()
    gpu_lines = [
        f"{gpu.name}  {gpu.device_id.library}:{gpu.device_id.id}  {human_bytes2(gpu.free_memory)} free"
        + ("  (simulated)" if plan.simulated else "")
        for gpu in plan.gpus
    ] or ["none"]
    lines = [
        f"model    {plan.model}  ({plan.total_layers} layers: {plan.total_layers - 1} repeating + output)",
        f"options  ctx {options.num_ctx} x {options.parallel} parallel, "
        f"batch {min(options.batch_size, options.num_ctx)}, KV cache {_cache_types(options)}, "
        f"flash attention {options.flash_attention_reason or ('on' if options.flash_attention == 1 else 'off')}, "
        f"num_gpu {'auto' if options.num_gpu < 0 else options.num_gpu}",
        f"system   {human_bytes2(plan.system.free_memory)} free of {human_bytes2(plan.system.total_memory)} RAM, "
        f"{human_bytes2(plan.system.free_swap)} swap free",
        "gpus     " + "\n         ".join(gpu_lines),
    ]
    if plan.simulated:
        lines.append("note     " + "\n         ".join(textwrap.wrap(SIMULATED_NOTE, 100)))
    lines += ["", "per layer"]
    lines += _table(["layer", "device", "weights", "KV cache", "total"], _layer_rows(plan), {2, 3, 4})
    lines += ["", "per device"]
    lines += _table(["device", "layers", "weights", "KV cache", "graph", "image graph", "total", "free"],
                    _device_rows(plan), {2, 3, 4, 5, 6, 7})
    lines += [
        "",
        f"layout   {plan.layout or '[] (everything on the CPU)'}",
        "passes   " + " -> ".join(f"{layout.sum()} layers" for layout in plan.passes),
        f"total    {human_bytes2(total)}, of which {human_bytes2(vram)} on GPUs",
        "fits     " + ("yes" if plan.fits else f"no: {plan.error}"),
        "",
        "why",
        *("  " + line for line in _why(plan)),
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command line


def add_plan_command(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", help="show the memory a model needs per device and layer, and its layout")
    plan.add_argument("model", help="a GGUF file")
    plan.add_argument("--ctx", type=int, default=LoadOptions.num_ctx, help="context length per sequence")
    plan.add_argument("--parallel", type=int, default=LoadOptions.parallel, help="sequences served at once")
    plan.add_argument("--batch", type=int, default=LoadOptions.batch_size, help="prompt batch size")
    plan.add_argument("--kv-type", default="", help="KV cache type: f16 (default), q8_0, q4_0")
    plan.add_argument("--kv-type-k", default="", help="the key cache's type, where it differs from --kv-type")
    plan.add_argument("--kv-type-v", default="", help="the value cache's type, where it differs from --kv-type")
    plan.add_argument("--flash-attention", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                      help="auto (default, as serve: on where every GPU supports it), on or off")
    plan.add_argument("--num-gpu", type=int, default=-1, help="layers to offload (default: as many as fit)")
    plan.add_argument("--gpu", action="append", default=[], metavar="LIBRARY:ID:FREE",
                      help="a simulated GPU, e.g. CUDA:GPU-0:8GiB (repeatable); default: the GPUs present")
    plan.add_argument("--projector", default="", metavar="MMPROJ",
                      help="a vision projector in its own GGUF (llama.cpp's mmproj), loaded beside the model")
    plan.add_argument("--draft", default="", metavar="GGUF",
                      help="a draft model for speculative decoding, counted with the output layer on the CPU")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--svg", metavar="FILE", help="also write the memory per device and layer as an SVG picture")
    plan.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; 1 when the loop found no layout the machine can hold."""
    for name, value in [("--ctx", args.ctx), ("--parallel", args.parallel), ("--batch", args.batch)]:
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    simulated = parse_gpus(args.gpu)
    gpus = simulated or present_gpus()
    setting = {"auto": None, "on": True, "off": False}[args.flash_attention]
    flash, flash_why = resolve_flash_attention(setting, gpus)
    options = LoadOptions(num_ctx=args.ctx, parallel=args.parallel, batch_size=args.batch, num_gpu=args.num_gpu,
                          flash_attention=flash, kv_cache_type=args.kv_type, flash_attention_reason=flash_why,
                          kv_cache_type_k=args.kv_type_k, kv_cache_type_v=args.kv_type_v,
                          projector_path=args.projector, draft_path=args.draft)
    plan = make_plan(args.model, options, gpus, bool(simulated), system_info())
    if args.svg:
        title = f"{args.model}: {plan.layout.sum()} of {plan.total_layers} layers on GPUs" + (
            " (simulated)" if plan.simulated else "") + ("" if plan.fits else " - does not fit")
        with open(args.svg, "w", encoding="utf-8") as out:
            out.write(memory_svg(plan.memory, title))
    if args.json:
        json.dump(plan_json(plan), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(plan_text(plan))
    return 0 if plan.fits else 1
