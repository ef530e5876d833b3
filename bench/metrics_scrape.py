"""Does scraping serve's /metrics slow decoding? 4 concurrent streams with and without a scraper polling
/metrics every 100 ms, interleaved.

    .venv/bin/python bench/metrics_scrape.py [--model GGUF] [--rounds 12] [--streams 4] [--n-predict 64] [--threads N]

Each round runs the same workload twice, once with the scraper and once without, the order swapped every
round, so the machine's drift hits both alike; the result is the median over rounds of the round's ratio
(tokens/s with scraping / without), with its spread. Also measured: how long one scrape takes (its latency
seen by the scraper) and serve's CPU time per scrape (200 back-to-back scrapes, serve's threads' CPU time
from /proc), which is what a scrape can take away from the event loop that relays tokens.
Prompts differ in every run (no prompt-cache hits). Default model: the real SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

from serve_bench import serve_generate, serve_pids, streams_once, thread_cpu  # noqa: E402
from serve_process import serve_process  # noqa: E402
from workers import progress  # noqa: E402


class Scraper:
    """GET /metrics every `interval` seconds on its own thread, timing each scrape."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval = url + "/metrics", interval
        self.latencies: list[float] = []
        self.size = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=10) as response:
                self.size = len(response.read())
            self.latencies.append(time.perf_counter() - start)
            self._stop.wait(max(self.interval - (time.perf_counter() - start), 0))

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def serve_cpu_per_scrape(url: str, pid: int, count: int = 200) -> float:
    """Milliseconds of serve's CPU per scrape, from back-to-back scrapes (the server otherwise idle)."""
    before = sum(thread_cpu(pid).values())
    for _ in range(count):
        urllib.request.urlopen(url + "/metrics", timeout=10).read()
    return 1e3 * (sum(thread_cpu(pid).values()) - before) / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a GGUF (default: SmolLM2-135M-Instruct from the test assets)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--words", type=int, default=40, help="prompt length in words")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between scrapes")
    parser.add_argument("--threads", type=int, default=0, help="the runner's num_thread (0: every core)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.model is None:
        import assets  # tests/assets.py: the real models the tests use

        args.model = assets.real_model("smollm2-135m-instruct")
    started = time.monotonic()
    work = HERE / "out" / "metrics-scrape"
    work.mkdir(parents=True, exist_ok=True)
    with serve_process(work / "models", OLLAMA_NUM_PARALLEL=str(args.streams)) as url:
        run = serve_generate(url, str(args.model), 4096, args.threads)
        run("warm up", 4)
        pids = serve_pids()
        cpu_ms = serve_cpu_per_scrape(url, pids["serve"])
        progress(f"serve CPU per scrape: {cpu_ms:.3f} ms")
        runs: dict[str, list[float]] = {"off": [], "on": []}
        latencies: list[float] = []
        size = 0
        for round_ in range(args.rounds):
            for mode in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
                if mode == "on":
                    with Scraper(url, args.interval) as scraper:
                        row = streams_once(run, args.streams, args.n_predict, args.words, pids, 2 * round_ + 1)
                    latencies += scraper.latencies
                    size = scraper.size
                else:
                    row = streams_once(run, args.streams, args.n_predict, args.words, pids, 2 * round_)
                runs[mode].append(row["aggregate_tps"])
                progress(f"round {round_ + 1}/{args.rounds}, scraping {mode}: {row['aggregate_tps']:.1f} t/s")
    ratios = [on / off for on, off in zip(runs["on"], runs["off"], strict=True)]
    result = {
        "model": str(args.model), "threads": args.threads, "streams": args.streams, "n_predict": args.n_predict,
        "rounds": args.rounds,
        "interval_s": args.interval, "minutes": round((time.monotonic() - started) / 60, 1),
        "tps_off_median": round(statistics.median(runs["off"]), 2),
        "tps_on_median": round(statistics.median(runs["on"]), 2),
        "ratio_on_off_median": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
        "scrapes": len(latencies), "scrape_ms_median": round(1e3 * statistics.median(latencies), 2),
        "scrape_ms_max": round(1e3 * max(latencies), 2), "metrics_bytes": size,
        "serve_cpu_ms_per_scrape": round(cpu_ms, 3),
        "rounds_tps": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
