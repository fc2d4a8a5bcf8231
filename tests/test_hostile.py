"""Hostile or broken clients: every kind of tests/hostile.py through every strategy (numpy level).

No reply may raise out of a strategy, move the global state beyond the documented bound
(docs/robustness.md), or stop the next round's downlink.
"""

import pytest

from hostile import KINDS, SPECS, run_case


def test_the_catalogue_is_large_enough():
    assert len(KINDS) >= 60 and len({k.name for k in KINDS}) == len(KINDS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_hostile_reply_is_refused_or_bounded(spec, kind):
    result = run_case(spec, kind)
    assert result.outcome in ("n/a", kind.expected(spec)), result
