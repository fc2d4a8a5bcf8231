"""``python -m bench.fednl``: the benchmark's command line (cli.py)."""

from .cli import main

main()
