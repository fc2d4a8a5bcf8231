"""Postcard's commands: what a user runs around the Flower app, not part of it.

``postcard.cli`` (the ``postcard`` command: Hydra runs and sweeps in simulation),
``postcard.pool`` (``postcard pool``: SmartFed's knowledge pool), ``postcard.demo``
(``make demo``), ``postcard.deploy`` and ``postcard.superlink`` (a SuperLink and SuperNodes
on one machine, TLS and node authentication). The app itself is ``fedapps`` (Flower
wiring), ``strategies`` (server) and ``clients`` (client side); nothing there imports this
package.
"""
