"""Hostile or broken clients: every kind of tests/hostile.py through every strategy it applies to
(numpy level).

No reply may raise out of a strategy, move the global state beyond the documented bound
(docs/robustness.md), or stop the next round's downlink.

Only applicable (kind, strategy) pairs are collected (``hostile.applicable_cases``, decided on a
freshly built strategy, no round run): a top-k body sent to an int4 strategy or a SmartFed id
sent to FedAvg cannot happen, and ran before as 333 "n/a" passes of 1,140, each building three
strategies and a round before saying so. ``test_the_applicability_table`` keeps the filter honest.
"""

import pytest

from hostile import KINDS, SPECS, applicable_cases, applies, run_case

CASES = applicable_cases()

# the defences every strategy must have, whatever its wire format or method: no kind of these
# groups may be filtered out for any strategy
GENERIC = ("identity", "metrics", "layout")


def test_the_applicability_table():
    names = [k.name for k in KINDS]
    assert len(set(names)) == len(names), "two kinds share a name (a case id would hide another)"
    for kind in KINDS:
        assert any(applies(spec, kind) for spec in SPECS), f"{kind.name} applies to no strategy: never tested"
    for spec in SPECS:
        skipped = [k.name for k in KINDS if k.group in GENERIC and not applies(spec, k)]
        assert not skipped, f"{spec.name}: generic kinds filtered out: {skipped}"
        assert any(applies(spec, k) for k in KINDS if k.group == "values"), spec.name
    # wire-format kinds reach exactly the strategies of that wire format
    for kind in KINDS:
        wires = {s.wire for s in SPECS if applies(s, kind)}
        if kind.group == "int4":
            assert wires == {"int4"}, kind.name
        elif kind.group == "compressed":
            assert len(wires) == 1 and wires <= {"topk", "powersgd"}, kind.name


@pytest.mark.parametrize("spec,kind", [pytest.param(s, k, id=f"{k.name}-{s.name}") for s, k in CASES])
def test_a_hostile_reply_is_refused_or_bounded(spec, kind):
    result = run_case(spec, kind)
    assert result.outcome == kind.expected(spec), result


def test_every_registered_method_meets_the_catalogue_as_the_class_it_runs():
    """#61: the catalogue follows the registry: every registered method has a spec (one of its own, or one
    generated from its record), each spec builds the strategy class the method's record names, and a method
    added tomorrow gets the generic one (here: a registered stand-in with FedAvgLoRA's class)."""
    from dataclasses import replace

    from fedapps import registry
    from hostile import _generated

    assert {s.algorithm for s in SPECS} == set(registry.METHODS)
    for spec in SPECS:
        assert type(spec.build()) is registry.get(spec.algorithm).strategy, spec.name
    tomorrow = replace(registry.get("fedavg-lora"), name="tomorrow")
    (spec,) = _generated({**registry.METHODS, "tomorrow": tomorrow})
    assert spec.name == "tomorrow" and type(spec.build()) is tomorrow.strategy
    built = spec.build()
    assert [k.name for k in KINDS if k.group in GENERIC and not k.applies(spec, built)] == []
