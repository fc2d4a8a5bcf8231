"""The run folder: config.yaml, metrics.jsonl, summary.json, plots, final global state.

``<output_dir>/<run_name>/`` where ``output_dir`` defaults to ``$POSTCARD_OUTPUTS`` or
``./outputs`` (made absolute at start: a ServerApp's working directory is the
SuperLink's, so relative paths would land somewhere surprising).

The folder is its user's alone (``fedapps.filemodes``): made ``0700``, its files ``0600`` (what
the run writes after each round, and the whole folder again when the run ends or fails), unless
``POSTCARD_UMASK`` says otherwise (``027``: the group may read; ``022``: everyone, as before).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from logging import INFO
from pathlib import Path

import numpy as np
from flwr.common.logger import log
from omegaconf import OmegaConf

from fedapps import linkbudget
from fedapps.config import to_yaml
from fedapps.filemodes import private_dir, private_file, secure_tree


def output_root(cfg) -> Path:
    root = cfg.get("output_dir") or os.environ.get("POSTCARD_OUTPUTS") or (Path.cwd() / "outputs")
    return Path(str(root)).expanduser().resolve()


def run_name(cfg) -> str:
    """The run folder's name: ``run_name``, else ``<date-time>_<algorithm>_<task>_<model>``."""
    return str(cfg.get("run_name") or f"{dt.datetime.now():%Y%m%d-%H%M%S}_{cfg.algorithm.name}_{cfg.task.name}_"
               f"{cfg.model.name}")


# the headline measures of a model; a task reports one as its ``metric`` (task.metric: initial_metric and
# final_metric, comparisons); an instruction task's evaluation reports both (clients.tasks.local: accuracy, and
# the perplexity of the responses), and a run shows the other beside its metric where a user looks
HEADLINE_METRICS = ("accuracy", "perplexity")


def secondary_metrics(metric: str, history: list[dict]) -> list[str]:
    """The headline metrics (:data:`HEADLINE_METRICS`) other than ``metric`` that the run's evaluation reported
    (in some round of ``history``): shown beside it in the console's table, ``summary.json`` and ``metrics.png``."""
    return [m for m in HEADLINE_METRICS
            if m != metric and any(r.get("eval", {}).get(m) is not None for r in history)]


class RunDir:
    """A run's folder: ``config.yaml``, ``metrics.jsonl`` (a line per round), ``summary.json``, plots.

    ``RunDir(cfg)`` makes a new folder under the output root; :meth:`reopen` continues an
    existing one (a resumed run, ``fedapps.checkpoint.open_run_dir``).
    """

    def __init__(self, cfg, path: Path | None = None) -> None:
        if path is None:
            name = run_name(cfg)
            path = output_root(cfg) / str(name)
            suffix = 1
            while path.exists():
                suffix += 1
                path = output_root(cfg) / f"{name}-{suffix}"
            private_dir(path, exist_ok=False)
        else:
            private_dir(path)
            secure_tree(path)  # a folder continued (resume) keeps nothing readable that a new one would not
        self.path = path
        self.cfg = cfg
        self.metric = str(cfg.task.metric)
        (path / "config.yaml").write_text(to_yaml(cfg))
        private_file(path / "config.yaml")
        self._header_printed = False

    @classmethod
    def reopen(cls, cfg, path: Path, history: list[dict]) -> RunDir:
        """An existing run folder, continued: its metrics.jsonl rewritten from ``history`` (rounds
        after the last checkpoint, from a crash between metrics.jsonl and the checkpoint, are
        dropped) and its summary removed until the run finishes again."""
        out = cls(cfg, path)
        tmp = path / ".metrics.jsonl.tmp"
        tmp.write_text("".join(json.dumps(record) + "\n" for record in history))
        private_file(tmp)
        tmp.replace(path / "metrics.jsonl")
        (path / "summary.json").unlink(missing_ok=True)
        return out

    # ------------------------------------------------------------------ per round
    def write_round(self, record: dict) -> None:
        with open(self.path / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        private_file(self.path / "metrics.jsonl")
        self._print_row(record)
        if self.cfg.get("tracking") == "tensorboard":
            self._track(record)

    def _track(self, record: dict) -> None:
        """The round's scalars (:func:`round_scalars`) as TensorBoard events in ``<run>/tensorboard``."""
        if getattr(self, "_writer", None) is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.path / "tensorboard"))
        for tag, value in round_scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=int(record["round"]))
        self._writer.flush()
        secure_tree(self.path / "tensorboard")

    def _close_tracking(self) -> None:
        if getattr(self, "_writer", None) is not None:
            self._writer.close()
            self._writer = None

    def _print_row(self, record: dict) -> None:
        clients = record["clients"]
        up = [c.get("uplink_payload_bytes") for c in clients if c.get("uplink_payload_bytes") is not None]
        down = [c.get("train_downlink_payload_bytes") for c in clients if c.get("train_downlink_payload_bytes")]
        losses = [c["train_loss"] for c in clients if "train_loss" in c]
        if not self._header_printed:  # the metric, and beside it what else the evaluation reports (perplexity)
            self._shown = [self.metric, *secondary_metrics(self.metric, [record])]
            log(INFO, "%5s | " + "%12s | " * len(self._shown) + "%10s | %14s | %14s | %8s | %s", "round",
                *self._shown, "train loss", "uplink B/client", "downlink B/client", "seconds", "refused")
            self._header_printed = True
        values = [record["eval"].get(m) for m in self._shown]
        log(INFO, "%5d | " + "%12s | " * len(values) + "%10s | %14s | %14s | %8.1f | %d", record["round"],
            *(f"{v:.4f}" if v is not None else "-" for v in values),
            f"{np.mean(losses):.4f}" if losses else "-",
            f"{int(np.mean(up)):,}" if up else "-",
            f"{int(np.mean(down)):,}" if down else "-",
            record["seconds"], len(record["refused"]))

    # ------------------------------------------------------------------ end of run
    def fail(self, err: BaseException, history: list[dict]) -> None:
        """Mark the folder as a failed run: ``summary.json`` with ``status: failed``, the error and
        what was recorded up to then (rounds in ``metrics.jsonl`` and ``checkpoint.npz`` stay, so
        ``resume`` can continue it)."""
        self._close_tracking()
        reason = f"{type(err).__name__}: {err}".strip() if str(err) else type(err).__name__
        summary = {"status": "failed", "error": reason,
                   "last_round": max((r["round"] for r in history), default=None),
                   "algorithm": self.cfg.algorithm.name, "task": self.cfg.task.name, "run_dir": str(self.path)}
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        secure_tree(self.path)
        log(INFO, "Run failed (%s); marked in %s", reason, self.path / "summary.json")

    def finish(self, history: list[dict], extra: dict | None = None) -> dict:
        self._close_tracking()
        summary = {"status": "completed", **summarize(self.cfg, history)}
        summary.update(extra or {})
        summary["run_dir"] = str(self.path)
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        try:
            plot_run(history, self.metric, self.path, run_title(self.cfg))
        except Exception as err:  # a plot must never lose the run's results
            log(INFO, "plots skipped: %s", err)
        secure_tree(self.path)  # and what the method's save_final wrote (adapter/, final_state.safetensors, ...)
        others = "".join(f"; {m} {fmt(summary.get(f'final_{m}'))} (round 0: {fmt(summary.get(f'initial_{m}'))})"
                         for m in secondary_metrics(self.metric, history))
        log(INFO, "Final %s: %s (round 0: %s)%s; uplink %s bytes per client per round",  # full precision: summary.json
            self.metric, fmt(summary.get("final_metric")), fmt(summary.get("initial_metric")), others,
            fmt(summary.get("uplink_bytes_per_client_round")))
        log(INFO, "Results in %s", self.path)
        return summary


def round_scalars(record: dict) -> dict[str, float]:
    """A round record of ``metrics.jsonl`` as named scalars (for experiment tracking): every numeric
    evaluation metric, the clients' mean training loss, the mean uplink and downlink payload bytes
    per client, and the round's seconds and refused / missing / bounded counts."""
    out = {f"eval/{k}": float(v) for k, v in record.get("eval", {}).items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    clients = record.get("clients", [])
    for tag, key in (("train/loss", "train_loss"), ("bytes/uplink_per_client", "uplink_payload_bytes"),
                     ("bytes/downlink_per_client", "train_downlink_payload_bytes")):
        values = [c[key] for c in clients if c.get(key) is not None]
        if values:
            out[tag] = float(np.mean(values))
    out["round/seconds"] = float(record.get("seconds", 0.0))
    for entry in ("refused", "missing", "bounded"):
        out[f"round/{entry}"] = float(len(record.get(entry, [])))
    return out


def count_by_kind(history: list[dict], entry: str) -> dict[str, int]:
    """How many replies of a run were refused (``entry='refused'``: identity, metrics, payload,
    client-error, round) or accepted with a bound applied (``'bounded'``), by kind."""
    counts: dict[str, int] = {}
    for record in history:
        for item in record.get(entry, []):
            kind = str(item.get("kind", "payload"))
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def summarize(cfg, history: list[dict]) -> dict:
    metric = str(cfg.task.metric)
    trained = [r for r in history if r["round"] > 0]
    up = [c["uplink_payload_bytes"] for r in trained for c in r["clients"] if "uplink_payload_bytes" in c]
    down = [c["train_downlink_payload_bytes"] for r in trained for c in r["clients"] if "train_downlink_payload_bytes" in c]
    up_msg = [c["uplink_message_bytes"] for r in trained for c in r["clients"] if "uplink_message_bytes" in c]
    up_wire = [c["uplink_wire_bytes"] for r in trained for c in r["clients"] if "uplink_wire_bytes" in c]
    values = [(r["round"], r["eval"].get(metric)) for r in history if r["eval"].get(metric) is not None]
    others = {}  # the other headline metric the evaluation reported (an instruction task's perplexity)
    for name in secondary_metrics(metric, history):
        series = [(r["round"], r["eval"][name]) for r in history if r["eval"].get(name) is not None]
        others[f"initial_{name}"] = series[0][1] if series[0][0] == 0 else None
        others[f"final_{name}"] = series[-1][1]
        others[f"{name}_by_round"] = {str(r): v for r, v in series}
    return {
        "algorithm": cfg.algorithm.name,
        "task": cfg.task.name,
        "model": cfg.model.name,
        "partition": cfg.partition.name,
        "rounds": int(cfg.rounds),
        "num_clients": int(cfg.num_clients) if cfg.num_clients else None,
        "metric": metric,
        "initial_metric": values[0][1] if values and values[0][0] == 0 else None,
        "final_metric": values[-1][1] if values else None,
        "metric_by_round": {str(r): v for r, v in values},
        **others,
        "final_client_metrics": {
            str(c.get("eval_partition-id", c["node_id"])): c.get(f"eval_{metric}")
            for c in (history[-1]["clients"] if history else [])
        },
        "uplink_bytes_per_client_round": float(np.mean(up)) if up else None,
        "uplink_message_bytes_per_client_round": float(np.mean(up_msg)) if up_msg else None,
        "uplink_wire_bytes_per_client_round": float(np.mean(up_wire)) if up_wire else None,
        "downlink_bytes_per_client_round": float(np.mean(down)) if down else None,
        "uplink_bytes_total": int(np.sum(up)) if up else 0,
        "refused_replies": sum(len(r["refused"]) for r in history),
        "refused_by_kind": count_by_kind(history, "refused"),
        "bounded_by_kind": count_by_kind(history, "bounded"),
        "wall_seconds": float(sum(r["seconds"] for r in history)),
        # what the rounds would take on a few real links, modelled from the measured bytes and seconds
        "link_budget": linkbudget.budget(history, metric, metric != "perplexity"),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def run_title(cfg) -> str:
    """A run's identity for its plots: ``algorithm · model · task · partition=… · rounds=… · seed=…``."""
    parts = [str(cfg.algorithm.name), str(cfg.model.name), str(cfg.task.name)]
    partition = str(OmegaConf.select(cfg, "partition.name") or "natural")
    return " · ".join(parts + [f"partition={partition}", f"rounds={cfg.rounds}", f"seed={cfg.seed}"])


def run_figure(history: list[dict], metric: str, title: str = ""):
    """The figure of ``metrics.png`` (None without an evaluated round): metric vs round (integer
    ticks) and metric vs cumulative uplink bytes per client, under the run's ``title``; then a panel
    vs round for each other headline metric the evaluation reported (:func:`secondary_metrics`: an
    instruction task's perplexity beside its accuracy).

    The bytes panel is drawn as :func:`draw_curves` draws a comparison's: every point a marker,
    round 0 (nothing sent yet) hollow at the first round's bytes, rather than at 0 on a log axis;
    the axis is logarithmic when the bytes span a decade or more, else linear (one round, or a few
    of the same size: a log axis within one decade has no tick, or labels that overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    curve = bytes_curve(history, metric)
    if not curve:
        return None
    rounds, values, cumulative = zip(*curve)
    others = secondary_metrics(metric, history)
    fig, axes = plt.subplots(1, 2 + len(others), figsize=(5 * (2 + len(others)), 4))
    axes[0].plot(rounds, values, marker="o")
    axes[0].set(xlabel="round", ylabel=metric, title=f"{metric} vs round")
    for ax, other in zip(axes[2:], others):
        points = [(r["round"], r["eval"][other]) for r in history if r.get("eval", {}).get(other) is not None]
        ax.plot(*zip(*points), marker="o", color="C1")
        ax.set(xlabel="round", ylabel=other, title=f"{other} vs round")
    for ax in (axes[0], *axes[2:]):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole: no 0.5 ticks
    sent = [(b, v) for b, v in zip(cumulative, values) if b > 0]
    start = [v for b, v in zip(cumulative, values) if b == 0][:1]
    if sent:
        xs, ys = zip(*sent)
        line, = axes[1].plot(xs, ys, marker="o")
        if start:  # round 0, before any upload
            axes[1].plot([xs[0]], start, marker="o", mfc="none", color=line.get_color())
        if max(xs) >= 10 * min(xs):
            axes[1].set_xscale("log")
        else:
            axes[1].xaxis.set_major_locator(MaxNLocator(nbins=4))
            axes[1].xaxis.set_major_formatter(EngFormatter(unit="B"))
    axes[1].set(xlabel="cumulative uplink bytes per client", ylabel=metric,
                title=f"{metric} vs bytes sent" + (" (hollow: round 0)" if start and sent else ""))
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_run(history: list[dict], metric: str, folder: Path, title: str = "") -> None:
    """metric vs round and metric vs cumulative uplink bytes per client (as comparison.png), titled
    with the run's identity (:func:`run_title`), in ``folder/metrics.png``."""
    import matplotlib.pyplot as plt

    fig = run_figure(history, metric, title)
    if fig is None:
        return
    fig.savefig(folder / "metrics.png", dpi=120)
    plt.close(fig)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """A run folder's ``metrics.jsonl``: one record per round, round 0 (the initial model) first."""
    with open(Path(run_dir) / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


def mean_train_loss(record: dict) -> float:
    """The clients' mean training loss in one round record of :func:`read_metrics`."""
    losses = [c["train_loss"] for c in record["clients"] if "train_loss" in c]
    if not losses:
        raise ValueError(f"round {record.get('round')} has no training loss (round 0, or every reply refused)")
    return sum(losses) / len(losses)


def bytes_curve(history: list[dict], metric: str) -> list[tuple[int, float, float]]:
    """(round, metric, cumulative uplink payload bytes per client) for every evaluated round:
    the bytes one client has sent so far (the mean over the round's senders, summed)."""
    points, total = [], 0.0
    for record in history:
        ups = [c["uplink_payload_bytes"] for c in record["clients"] if "uplink_payload_bytes" in c]
        total += sum(ups) / len(ups) if ups else 0.0
        if record["eval"].get(metric) is not None:
            points.append((record["round"], record["eval"][metric], total))
    return points


def cumulative_curve(run_dir: str | Path, metric: str) -> list[tuple[int, float, float]]:
    """:func:`bytes_curve` of a run folder's ``metrics.jsonl``."""
    return bytes_curve(read_metrics(run_dir), metric)


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "-" if value is None else str(value)
