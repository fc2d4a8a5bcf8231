"""fedapps.pulls: Flower's retry schedule for unavailable objects, shortened where Postcard runs."""

import time

import pytest

from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

from fedapps.pulls import prompt_object_pulls


@pytest.fixture
def restore_defaults():
    saved = {name: dict(getattr(inflatable_utils, name).__kwdefaults__)
             for name in ("pull_objects", "pull_and_inflate_object_from_tree")}
    yield
    for name, defaults in saved.items():
        getattr(inflatable_utils, name).__kwdefaults__ = defaults


def late_object(after: float):
    """A pull function whose object becomes available ``after`` seconds from now."""
    ready = time.monotonic() + after

    def pull(object_id: str) -> bytes:
        if time.monotonic() < ready:
            raise ObjectUnavailableError(object_id)
        return b"content"

    return pull


def test_an_object_that_arrives_late_is_pulled_promptly(restore_defaults):
    start = time.monotonic()
    assert inflatable_utils.pull_objects(["a"], late_object(0.3)) == {"a": b"content"}
    flower = time.monotonic() - start  # Flower's schedule: tries at 0, ~1 s
    assert flower > 0.7
    assert "retry after 0.05 s" in prompt_object_pulls()
    start = time.monotonic()
    assert inflatable_utils.pull_objects(["a"], late_object(0.3)) == {"a": b"content"}
    assert time.monotonic() - start < 0.7
    defaults = inflatable_utils.pull_and_inflate_object_from_tree.__kwdefaults__
    assert defaults["initial_backoff"] == 0.05 and defaults["backoff_cap"] == 0.5
    assert defaults["max_tries_per_object"] is None and defaults["max_time"] > 3600  # gives up by time, as before


def test_bad_settings_and_a_flower_without_the_keywords(restore_defaults, monkeypatch):
    with pytest.raises(ValueError, match="initial <= cap"):
        prompt_object_pulls(1.0, 0.5)
    monkeypatch.setattr(inflatable_utils, "pull_objects", lambda ids, fn: {})
    assert prompt_object_pulls().startswith("object pulls unchanged")
