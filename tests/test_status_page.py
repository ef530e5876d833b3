"""The status page (GET /status) in a real browser: headless Chromium (Debian's `chromium` package) loads it
while serve holds two real models, runs its script, and the rendered DOM must show each model with the
per-device bytes of its runner's memory report and /api/ps's sizes; `?plan=` plans a model that is not loaded.

Skipped only when chromium is not installed (CI installs it: .ci/run).
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from serve_process import serve_process

httpx = pytest.importorskip("httpx")

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def chromium(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    """Headless Chromium, offline-minded: no sandbox (root in CI), no GPU, no background traffic. The virtual
    time budget lets the page's fetches finish before the DOM is dumped or the screenshot taken."""
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=10000", *extra, url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, check=True)


class Dom(HTMLParser):
    """What the page rendered: per model section, its size spans, device table cells and SVG bars."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict[str, str]]] = []
        self.headings: list[str] = []
        self.sizes: dict[str, dict[str, int]] = defaultdict(dict)
        self.cells: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
        self.bars: dict[str, dict[tuple[str, str, str], int]] = defaultdict(dict)
        self.plan_results: list[tuple[str, str]] = []
        self.why: list[str] = []

    def _within(self, key: str) -> str | None:
        return next((attrs[key] for _, attrs in reversed(self.stack) if key in attrs), None)

    def _section(self) -> str:
        """The model a node belongs to; the plan's output counts as `plan`."""
        for _, attrs in reversed(self.stack):
            if attrs.get("class") == "model":
                return attrs["data-model"]
            if attrs.get("id") == "plan":
                return "plan"
        return ""

    def handle_starttag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        attrs = {k: v or "" for k, v in attrs_list}
        self.stack.append((tag, attrs))
        section = self._section()
        cls = attrs.get("class", "")
        if cls in ("size", "size-vram"):
            self.sizes[section][cls] = int(attrs["data-bytes"])
        elif tag == "td" and "data-kind" in attrs:
            self.cells[section][self._within("data-device") or ""][attrs["data-kind"]] = int(attrs["data-bytes"])
        elif tag == "rect" and "data-kind" in attrs:
            self.bars[section][(attrs["data-device"], attrs["data-layer"], attrs["data-kind"])] = \
                int(attrs["data-bytes"])
        if tag in VOID:
            self.stack.pop()

    def handle_startendtag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs_list)
        if tag not in VOID:
            self.stack.pop()

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        if not self.stack:
            return
        tag, attrs = self.stack[-1]
        if attrs.get("class") == "model-name":
            self.headings.append(data)
        elif attrs.get("class") == "plan-result":
            self.plan_results.append((attrs["data-model"], data))
        elif tag == "li" and len(self.stack) > 1 and self.stack[-2][1].get("class") == "why":
            self.why.append(data)


def device_totals(report: dict) -> dict[str, dict[str, int]]:
    """Per device from the runner's BackendMemory JSON: the CPU's weights include the input weights."""
    out = {}
    for device, extra in [(report["CPU"], report["InputWeights"]), *((gpu, 0) for gpu in report["GPUs"] or [])]:
        weights, cache = extra + sum(device["Weights"] or []), sum(device["Cache"] or [])
        out[device["Name"]] = {"weights": weights, "kv_cache": cache, "graph": device["Graph"],
                               "total": weights + cache + device["Graph"]}
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path, gemma3_path: Path) -> Iterator[str]:
    root = tmp_path_factory.mktemp("status-page")
    with serve_process(root / "models") as url:
        for model in (smollm2_path, gemma3_path):
            response = httpx.post(url + "/api/generate", timeout=300, json={
                "model": str(model), "prompt": "Hello", "stream": False, "keep_alive": "1h",
                "options": {"num_predict": 4}})
            assert response.status_code == 200, response.text
        yield url


def test_the_page_shows_both_models_with_their_runners_memory(server, smollm2_path, gemma3_path, stories_path,
                                                              tmp_path):
    names = {str(smollm2_path), str(gemma3_path)}
    dom = Dom()
    dom.feed(chromium(tmp_path, f"{server}/status?plan={stories_path}", "--dump-dom").stdout)
    ps = {m["name"]: m for m in httpx.get(server + "/api/ps").json()["models"]}
    status = {m["name"]: m for m in httpx.get(server + "/api/status").json()["models"]}
    assert set(ps) == set(status) == names, "both models must still be loaded"

    assert sorted(dom.headings) == sorted(names)
    for name in names:
        assert dom.sizes[name] == {"size": ps[name]["size"], "size-vram": ps[name]["size_vram"]}
        expected = device_totals(status[name]["memory"])
        assert dom.cells[name] == expected
        assert sum(device["total"] for device in dom.cells[name].values()) == ps[name]["size"]
        report = status[name]["memory"]["CPU"]
        assert expected["CPU"]["kv_cache"] > 0 and expected["CPU"]["graph"] > 0
        # the picture: one weights and one KV bar per layer (and the input slot), the device's graph
        bars = dom.bars[name]
        assert len(bars) == 2 * (len(report["Weights"]) + 1) + 1
        for i, (weights, cache) in enumerate(zip(report["Weights"], report["Cache"], strict=True)):
            layer = "output" if i == len(report["Weights"]) - 1 else str(i)
            assert bars[("CPU", layer, "weights")] == weights and bars[("CPU", layer, "kv_cache")] == cache
        assert bars[("CPU", "input", "weights")] == status[name]["memory"]["InputWeights"]
        assert bars[("CPU", "graph", "graph")] == report["Graph"]

    # a model that is not loaded is planned, with its own table and picture
    planned = httpx.get(server + "/api/status/plan", params={"model": str(stories_path)}, timeout=300).json()
    assert dom.plan_results == [
        (str(stories_path), f"fits: {planned['offloaded_layers']} of {planned['total_layers']} layers on GPUs")]
    assert dom.cells["plan"] == device_totals(planned["memory"])
    assert dom.why == planned["why"] and dom.why
    assert dom.bars["plan"][("CPU", "input", "weights")] == planned["memory"]["InputWeights"]
    assert str(stories_path) not in ps


def test_a_screenshot_of_the_page(server, tmp_path):
    shot = tmp_path / "status.png"
    chromium(tmp_path, server + "/status", "--hide-scrollbars", "--window-size=940,1300", f"--screenshot={shot}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a blank page of this size is ~5 kB


def test_plan_of_an_unknown_model_is_a_404_and_no_model_a_400(server):
    response = httpx.get(server + "/api/status/plan", params={"model": "no-such-model"})
    assert response.status_code == 404 and response.json() == {"error": "model 'no-such-model' not found"}
    response = httpx.get(server + "/api/status/plan")
    assert response.status_code == 400 and response.json() == {"error": "model is required"}


def test_the_page_opens_no_cors_and_keeps_ollamas_root(server):
    page = httpx.get(server + "/status", headers={"Origin": "https://evil.example"})
    assert page.status_code == 403  # a foreign page cannot read it (serve's CORS rules apply unchanged)
    page = httpx.get(server + "/status")
    assert page.status_code == 200 and "Access-Control-Allow-Origin" not in page.headers
    assert "connect-src 'self'" in page.headers["Content-Security-Policy"]
    assert httpx.get(server + "/").text == "Ollama is running"
