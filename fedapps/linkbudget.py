"""Link budgets: what a run's rounds would take on real links, from the bytes and seconds it measured.

A **model**, not a measurement of those links: each client's round is

    uplink bytes × 8 / up-rate  +  downlink bytes × 8 / down-rate  +  its measured compute seconds

with the bytes as they travelled (the uplink on Flower's wire when recorded, else the whole message;
the downlink messages of training and evaluation) and the compute seconds the client measured on
*this* machine (``client-seconds``; not scaled to the device of the profile). A synchronous round
waits for its slowest client, so a round takes the largest of its clients' times; time-to-metric is
the sum of the rounds' times until the global model first reaches a target (by default the run's
final metric). Latency, retransmissions and the server's own seconds are left out. Under secure
aggregation or differential privacy a client reports no timing: its compute counts as 0 there and
the budget says so (``compute_measured``).

    postcard link-budget RUN_DIR [--target 45] [--profile phone-slow ...]

``summary.json`` of every run carries the same (``link_budget``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LinkProfile:
    name: str
    what: str
    up_mbps: float  # megabits per second, client -> server
    down_mbps: float  # server -> client


# a few documented device profiles (rates as commonly quoted for such links; edit or pass your own)
PROFILES = {p.name: p for p in (
    LinkProfile("phone-slow", "a phone on a slow mobile link (3G-class)", up_mbps=0.25, down_mbps=1.0),
    LinkProfile("phone-4g", "a phone on a typical 4G link", up_mbps=5.0, down_mbps=20.0),
    LinkProfile("home", "a home broadband connection", up_mbps=10.0, down_mbps=50.0),
    LinkProfile("datacentre", "a data-centre node", up_mbps=1000.0, down_mbps=1000.0),
)}


def client_seconds(client: dict, profile: LinkProfile) -> dict:
    """One client's round on ``profile``: seconds up, down, computing, and in all (None: it did not train)."""
    up = client.get("uplink_wire_bytes", client.get("uplink_message_bytes"))
    if up is None:
        return {}
    down = sum(client.get(f"{phase}_downlink_message_bytes", 0) or 0 for phase in ("train", "eval"))
    compute = sum(client.get(f"{phase}_client-seconds", 0) or 0 for phase in ("train", "eval"))
    out = {"up": up * 8 / (profile.up_mbps * 1e6), "down": down * 8 / (profile.down_mbps * 1e6),
           "compute": float(compute)}
    out["total"] = out["up"] + out["down"] + out["compute"]
    return out


def round_seconds(record: dict, profile: LinkProfile) -> float | None:
    """A round on ``profile``: its slowest training client's time (None for round 0 or a round nobody trained)."""
    times = [t["total"] for t in (client_seconds(c, profile) for c in record.get("clients", [])) if t]
    return max(times) if times else None


def _reached(value, target, higher_is_better: bool) -> bool:
    return value is not None and (value >= target if higher_is_better else value <= target)


def budget(history: list[dict], metric: str, higher_is_better: bool, target: float | None = None,
           profiles: dict[str, LinkProfile] = PROFILES) -> dict:
    """Per profile: each round's modelled seconds, their sum, and the seconds until the global model first
    reaches ``target`` (default: the last evaluated value of ``metric``); labelled as a model."""
    values = [(r["round"], r.get("eval", {}).get(metric)) for r in history]
    evaluated = [v for _, v in values if v is not None]
    if target is None and evaluated:
        target = evaluated[-1]
    compute_measured = any(c.get("train_client-seconds") is not None for r in history for c in r.get("clients", []))
    out = {"model": "uplink bytes / up-rate + downlink bytes / down-rate + compute seconds measured on this machine; "
                    "a round waits for its slowest client (fedapps.linkbudget)",
           "metric": metric, "target": target, "compute_measured": compute_measured, "profiles": {}}
    for name, profile in profiles.items():
        rounds, elapsed, reached = {}, 0.0, None
        for record, (r, value) in zip(history, values):
            seconds = round_seconds(record, profile)
            if seconds is not None:
                rounds[str(r)] = seconds
                elapsed += seconds
            if reached is None and target is not None and _reached(value, target, higher_is_better):
                reached = elapsed
        out["profiles"][name] = {"what": profile.what, "up_mbps": profile.up_mbps, "down_mbps": profile.down_mbps,
                                 "round_seconds": rounds, "total_seconds": elapsed, "seconds_to_target": reached}
    return out


def table(result: dict) -> str:
    """The budget as a markdown table, a row per profile."""
    lines = [f"Link budget (a model: {result['model']}); target {result['metric']} {result['target']}"
             + ("" if result["compute_measured"] else " — no client timing recorded: compute counts as 0"), "",
             "| profile | up / down Mbit/s | median round s | all rounds s | s to target |", "|---|---|---:|---:|---:|"]
    for name, p in result["profiles"].items():
        rounds = sorted(p["round_seconds"].values())
        median = rounds[len(rounds) // 2] if rounds else math.nan
        reach = "not reached" if p["seconds_to_target"] is None else f"{p['seconds_to_target']:,.1f}"
        lines.append(f"| {name} ({p['what']}) | {p['up_mbps']:g} / {p['down_mbps']:g} | {median:,.2f} | "
                     f"{p['total_seconds']:,.1f} | {reach} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="postcard link-budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run folder (metrics.jsonl, summary.json)")
    parser.add_argument("--target", type=float, default=None, help="the metric to reach (default: the run's final)")
    parser.add_argument("--profile", nargs="+", choices=sorted(PROFILES), default=sorted(PROFILES))
    args = parser.parse_args(argv)
    metrics, summary = args.run_dir / "metrics.jsonl", args.run_dir / "summary.json"
    if not metrics.is_file() or not summary.is_file():
        print(f"postcard link-budget: {args.run_dir} is not a run folder (no metrics.jsonl and summary.json)",
              file=sys.stderr)
        return 2
    history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    meta = json.loads(summary.read_text())
    metric = str(meta.get("metric"))
    print(table(budget(history, metric, metric != "perplexity", args.target,
                       {name: PROFILES[name] for name in args.profile})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
