"""Helpers every native route shares, that need no server."""

from ollama_engine.api.native import created_at


def test_created_at_is_gos_rfc3339nano_and_its_cached_seconds_follow_the_clock():
    """Each streamed chunk has a created_at; the seconds are formatted once per second and must never lag."""
    assert created_at(1_700_000_000_123_456_000) == "2023-11-14T22:13:20.123456Z"
    assert created_at(1_700_000_000_000_000_000) == "2023-11-14T22:13:20Z"
    assert created_at(1_700_000_001_500_000_000) == "2023-11-14T22:13:21.5Z"
    assert created_at(1_700_000_000_000_000_001) == "2023-11-14T22:13:20.000000001Z"
    assert created_at().endswith("Z")
