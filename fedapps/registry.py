"""The registered methods: ``algorithm=<name>`` picks one of these records.

Each method's module (``fedapps/<method>.py``) defines its :class:`fedapps.method.Method`
record; registering it is one line below. ``conf/algorithm/<name>.yaml`` is its config
group (a test checks that the two lists agree).
"""

from __future__ import annotations

from fedapps import baselines, fedala, fednl, fedssi, flite, smartfed
from fedapps.method import Method

METHODS: dict[str, Method] = {}


def register(method: Method) -> None:
    if method.name in METHODS:
        raise ValueError(f"method '{method.name}' is registered twice")
    METHODS[method.name] = method


def get(name: str) -> Method:
    if name not in METHODS:
        raise KeyError(f"no method registered as '{name}'; known: {', '.join(sorted(METHODS))}")
    return METHODS[name]


for method in baselines.METHODS:  # fedavg-lora, fedprox, ffa-lora, fedavg-full, topk-ef, powersgd
    register(method)
register(flite.METHOD)
register(fednl.METHOD)
register(fedala.METHOD)
register(fedssi.METHOD)
register(smartfed.METHOD)
