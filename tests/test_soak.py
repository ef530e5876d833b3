"""The soak through serve, bounded for CI (tools/soak.py runs the full 1,000 requests; RELIABILITY.md has the figures).

30 requests over two models, 4 clients at a time, with random disconnects, cancels and keep-alive values: every
request completes, is cancelled or disconnects as chosen (no error), nothing is left in flight or queued, a last
request works, serve's RSS grows less than 100 MiB after the warm-up, no runner outlives serve, no traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from soak import soak  # noqa: E402


def test_soak_through_serve_leaks_nothing(tmp_path: Path) -> None:
    report = soak(requests=30, concurrency=4, seed=1, workdir=tmp_path)
    assert sum(report["outcomes"].values()) == 30
    assert "error" not in report["outcomes"], report["errors"]
    assert report["outcomes"].get("ok", 0) >= 12, report["outcomes"]
    assert report["in_flight_after"] == [] and report["last_request_ok"], report
    assert report["rss"]["growth_mib"] < 100, report["rss"]
    assert report["runners_seen"] >= 2 and report["runners_left"] == [], report
    assert report["serve_exit_code"] == 0 and report["tracebacks_in_log"] == 0, report
