"""Prompt object pulls: Flower's retry schedule for a message's objects, shortened.

Flower 1.42 moves a message as a tree of objects. A receiver often asks for an object before
the sender has finished pushing it (a SuperNode creates the task first and pulls the message's
objects after; a ServerApp asks for a reply as soon as the SuperLink lists it), gets
"unavailable", and waits before asking again: 1 s, then 2, 4, 8, up to 10 s between tries
(``PULL_INITIAL_BACKOFF`` and ``PULL_BACKOFF_CAP`` in ``flwr/supercore/constant.py``, bound as
the keyword defaults of ``pull_objects`` and ``pull_and_inflate_object_from_tree`` in
``flwr/supercore/inflatable/inflatable_utils.py``; neither is configurable). An object that
arrives 0.1 s late can therefore cost seconds, once per message. Measured on loopback: a warm
worker's pull of a message took 1.2-2.8 s for a few KB on the tiny Llama (docs/deploy.md,
section 9).

:func:`prompt_object_pulls` makes the processes Postcard runs (the warm node worker, the
ServerApp) retry after ``initial`` seconds, doubling up to ``cap``: a few more requests to a
SuperNode or SuperLink that is at most a network hop away, no change to what is pulled. A pull
still gives up after Flower's ``max_time`` (2 h), not after a count of tries.
It changes those two keyword defaults of flwr 1.42.0's functions and nothing else; with
another flwr (or functions without those keywords) it changes nothing and says why.
"""

from __future__ import annotations

INITIAL = 0.05  # seconds before the first retry of an unavailable object (Flower: 1)
CAP = 0.5  # the longest wait between retries (Flower: 10)


def prompt_object_pulls(initial: float = INITIAL, cap: float = CAP) -> str:
    """Shorten Flower's retry schedule for unavailable objects in this process; returns what it
    did, in one line (for the caller's log)."""
    if not 0 < initial <= cap:
        raise ValueError(f"prompt_object_pulls: need 0 < initial <= cap, got {initial} and {cap}")
    try:
        from flwr.supercore.inflatable import inflatable_utils
    except ImportError as err:
        return f"object pulls unchanged: {err}"
    changed = []
    for name in ("pull_objects", "pull_and_inflate_object_from_tree"):
        fn = getattr(inflatable_utils, name, None)
        defaults = getattr(fn, "__kwdefaults__", None) or {}
        if "initial_backoff" in defaults and "backoff_cap" in defaults:
            # the give-up point stays time-bound (max_time, 2 h): 500 tries (Flower's count) at these
            # shorter waits would give up after ~4 minutes instead of ~80, too soon for a slow link
            fn.__kwdefaults__ = {**defaults, "initial_backoff": float(initial), "backoff_cap": float(cap),
                                 "max_tries_per_object": None}
            changed.append(name)
    if len(changed) < 2:
        return "object pulls unchanged: this flwr's pull functions have no initial_backoff/backoff_cap keywords"
    return f"object pulls retry after {initial:g} s, at most {cap:g} s apart (Flower: 1 s, 10 s)"
