"""A memory report as a picture: one panel per device, one stacked bar per layer (weights, KV cache), and the
device's compute graph as its last bar. `plan --svg` writes it; serve's status page shows the same drawing.

Every bar carries its exact numbers (`data-device`, `data-layer`, `data-kind`, `data-bytes`), and every panel
its device totals, so a test (or a person with the browser's inspector) can check the picture against the
report it was drawn from. All panels share one scale, so bars compare across devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from ollama_engine.ml.memory import BackendMemory, DeviceMemory, human_bytes2

COLORS = {"weights": "#4e79a7", "kv_cache": "#f28e2b", "graph": "#59a14f"}
LABELS = {"weights": "weights", "kv_cache": "KV cache", "graph": "compute graph"}
PANEL_HEIGHT = 110  # pixels of bar area per device
LEFT = 80  # the device name and scale
BAR_AREA = 720  # pixels for one panel's bars
FONT = "font-family:sans-serif;font-size:11px"
SHORT = {"input": "in", "output": "out"}  # layer names under the bars


@dataclass
class DeviceBars:
    """One device's bars: per layer (name, weights, KV cache), and its graph."""

    name: str
    layers: list[tuple[str, int, int]]
    graph: int

    @property
    def weights(self) -> int:
        return sum(w for _, w, _ in self.layers)

    @property
    def cache(self) -> int:
        return sum(c for _, _, c in self.layers)

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.graph


def device_bars(memory: BackendMemory) -> list[DeviceBars]:
    """The GPUs in report order, then the CPU, whose input bar holds the input weights (token embeddings)."""
    total_layers = len(memory.cpu.weights)
    names = [str(i) for i in range(total_layers - 1)] + ["output"] if total_layers else []

    def layers(device: DeviceMemory) -> list[tuple[str, int, int]]:
        weights = list(device.weights) + [0] * (total_layers - len(device.weights))
        cache = list(device.cache) + [0] * (total_layers - len(device.cache))
        return [(name, weights[i], cache[i]) for i, name in enumerate(names)]

    # every panel starts with the input slot (empty on a GPU), so a layer's bars line up across devices
    bars = [DeviceBars(gpu.name or gpu.device_id.id, [("input", 0, 0), *layers(gpu)], gpu.graph)
            for gpu in memory.gpus]
    bars.append(DeviceBars(memory.cpu.name or "CPU", [("input", memory.input_weights, 0), *layers(memory.cpu)],
                           memory.cpu.graph))
    return bars


def memory_svg(memory: BackendMemory, title: str = "") -> str:
    """The report as a standalone SVG document (UTF-8 text, no external references)."""
    devices = device_bars(memory)
    most = max([max(w + c for _, w, c in d.layers) if d.layers else 0 for d in devices]
               + [d.graph for d in devices] + [1])
    slots = max(len(d.layers) for d in devices) + 2  # a gap, then the graph bar
    step = BAR_AREA / slots
    bar = max(step * 0.8, 1.0)
    top = 44 if title else 26
    panel = PANEL_HEIGHT + 46
    width = LEFT + BAR_AREA + 20
    height = top + panel * len(devices) + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" class="memory-plan" data-scale-bytes="{most}">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>']
    if title:
        out.append(f'<text x="8" y="18" style="font-family:sans-serif;font-size:14px;font-weight:bold">'
                   f'{escape(title)}</text>')
    legend_y = top - 12
    for i, kind in enumerate(("weights", "kv_cache", "graph")):
        x = LEFT + i * 130
        out.append(f'<rect x="{x}" y="{legend_y - 9}" width="10" height="10" fill="{COLORS[kind]}"/>'
                   f'<text x="{x + 14}" y="{legend_y}" style="{FONT}">{LABELS[kind]}</text>')
    for index, device in enumerate(devices):
        out += _panel(device, top + index * panel, most, step, bar)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _panel(device: DeviceBars, y0: float, most: int, step: float, bar: float) -> list[str]:
    base = y0 + 18 + PANEL_HEIGHT  # the bars' baseline
    summary = (f"{device.name}: weights {human_bytes2(device.weights)}, KV cache {human_bytes2(device.cache)}, "
               f"graph {human_bytes2(device.graph)}, total {human_bytes2(device.total)}")
    out = [f'<g class="device" data-device={quoteattr(device.name)} data-weights="{device.weights}" '
           f'data-kv-cache="{device.cache}" data-graph="{device.graph}" data-total="{device.total}">',
           f'<text x="8" y="{y0 + 12}" style="{FONT};font-weight:bold">{escape(summary)}</text>',
           f'<line x1="{LEFT}" y1="{base}" x2="{LEFT + BAR_AREA}" y2="{base}" stroke="#888"/>',
           f'<text x="{LEFT - 4}" y="{y0 + 26}" text-anchor="end" style="{FONT}">{human_bytes2(most)}</text>',
           f'<text x="{LEFT - 4}" y="{base}" text-anchor="end" style="{FONT}">0</text>']

    def rect(x: float, height: float, y: float, kind: str, layer: str, size: int) -> str:
        tip = f"{device.name} layer {layer}: {LABELS[kind]} {human_bytes2(size)} ({size} bytes)"
        return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{height:.1f}" fill="{COLORS[kind]}" '
                f'data-device={quoteattr(device.name)} data-layer="{layer}" data-kind="{kind}" '
                f'data-bytes="{size}"><title>{escape(tip)}</title></rect>')

    def tick(x: float, text: str) -> str:
        return (f'<text x="{x + bar / 2:.1f}" y="{base + 12}" text-anchor="middle" '
                f'style="font-family:sans-serif;font-size:9px">{escape(text)}</text>')

    def scaled(size: int) -> float:
        return PANEL_HEIGHT * size / most

    for i, (layer, weights, cache) in enumerate(device.layers):
        x = LEFT + i * step
        w, c = scaled(weights), scaled(cache)
        out.append(rect(x, w, base - w, "weights", layer, weights))
        out.append(rect(x, c, base - w - c, "kv_cache", layer, cache))
        if layer in ("input", "output") or i % _label_every(len(device.layers)) == 0:
            out.append(tick(x, SHORT.get(layer, layer)))
    x = LEFT + (len(device.layers) + 1) * step
    g = scaled(device.graph)
    out.append(rect(x, g, base - g, "graph", "graph", device.graph))
    out.append(tick(x, "graph"))
    out.append(f'<text x="{LEFT}" y="{base + 26}" style="font-family:sans-serif;font-size:10px;fill:#555">layer</text>')
    out.append("</g>")
    return out


def _label_every(count: int) -> int:
    """Label every layer while they fit, else every 2nd, 5th, 10th..."""
    for every in (1, 2, 5, 10, 20, 50):
        if count / every <= 40:
            return every
    return 100


def totals(devices: Sequence[DeviceBars]) -> dict[str, dict[str, int]]:
    """Per device: weights, kv_cache, graph, total (the numbers the panels show)."""
    return {d.name: {"weights": d.weights, "kv_cache": d.cache, "graph": d.graph, "total": d.total} for d in devices}
