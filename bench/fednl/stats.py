"""The statistics of the report: MMLU's paired comparisons, FedNL paired at each NIAH length, paired
loss differences, and the aggregation drop's interval."""

from __future__ import annotations

from .runs import MMLU_CLIENTS, round0_of


def paired_report(items: dict, specs: list, margin: float) -> dict:
    """The paired comparisons of :func:`mmlu.mmlu_paired` from per-question scores: ``items`` maps each
    algorithm spec (and ``round 0: <label>``) to its scores (``postcard.compare`` format)."""
    import numpy as np

    from postcard.compare import compare, wilson

    result = {"margin": margin, "items": len(next(iter(items.values()))["index"])}
    if "fedavg-lora" in items:
        result["vs_fedavg_lora"] = compare({"fedavg-lora": items["fedavg-lora"],
                                            **{k: v for k, v in items.items() if k != "fedavg-lora"}},
                                           "fedavg-lora", "accuracy", margin=margin)
    if "fednl:ablate" in items:
        result["vs_ablation"] = compare({"fednl:ablate": items["fednl:ablate"],
                                         **{k: v for k, v in items.items() if k.startswith("fednl:") and
                                            k != "fednl:ablate"}}, "fednl:ablate", "accuracy", margin=margin)
    # FedNL against every other baseline (fedavg-lora is the table's own reference column)
    fednl_specs = [k for k in specs if k.startswith("fednl:") and k != "fednl:ablate"]
    result["fednl_vs_baselines"] = {
        base: compare({base: items[base], **{k: items[k] for k in fednl_specs}}, base, "accuracy", margin=margin)
        for base in specs if not base.startswith("fednl:") and base != "fedavg-lora"} if fednl_specs else {}
    result["moved"] = {spec: compare({"start": items[f"round 0: {round0_of(spec)}"], "final": items[spec]},
                                     "start", "accuracy", margin=margin)["runs"]["final"]
                       for spec in specs}
    result["accuracy"] = {name: {"accuracy": float(np.mean(r["correct"])),
                                 "ci95": wilson(int(np.sum(r["correct"] > 0.5)), len(r["correct"]))}
                          for name, r in items.items()}
    return result


def niah_paired(items: dict, lengths, margin: float) -> dict:
    """At each length, FedNL against its ablation and against fedavg-lora on the same prompts: the
    accuracy difference (McNemar) and the answer letter's cross-entropy, paired prompt by prompt."""
    from postcard.compare import compare

    paired = {}
    if "fednl" not in items:
        return paired
    for length in lengths:
        for ref in ("fednl-ablate", "fedavg-lora"):
            if ref not in items:
                continue
            sub = {name: {k: v[items[name]["length"] == length] for k, v in items[name].items()}
                   for name in (ref, "fednl")}
            if not len(sub[ref]["index"]):
                continue
            row = compare(sub, ref, "accuracy", margin=margin)["runs"]["fednl"]["accuracy_diff"]
            row["loss_diff"] = loss_diffs(sub, ref, ["fednl"]).get("fednl")
            paired.setdefault(str(length), {})[ref] = row
    return paired


def loss_diffs(items: dict, ref: str, others: list) -> dict:
    """Each of ``others`` against ``ref``, paired item by item (``postcard.compare``'s loss_diff)."""
    from postcard.compare import compare

    runs = compare({ref: items[ref], **{k: items[k] for k in others}}, ref, "perplexity")["runs"]
    return {k: v["loss_diff"] for k, v in runs.items() if "loss_diff" in v}


def drop_interval(run: dict, questions: int) -> tuple[float, float, float]:
    """Mean aggregation drop over the clients (each scored on ``questions`` questions) and its 95%
    normal interval, unpaired: var = sum over clients of p(1-p)/n for the local and the federated
    accuracy, divided by the number of clients squared."""
    import math

    drops = [run["aggregation_drop"][c] for c in MMLU_CLIENTS]
    federated = [run["per_client"][c] for c in MMLU_CLIENTS]
    local = [f + d for f, d in zip(federated, drops)]
    variance = sum(p * (1 - p) / questions for p in (*federated, *local)) / len(drops) ** 2
    mean, half = sum(drops) / len(drops), 1.959964 * math.sqrt(variance)
    return mean, mean - half, mean + half


def t_interval(values) -> dict:
    """Mean, 95% t interval and the two-sided p of a one-sample t test against 0 (``postcard.stats``)."""
    from postcard.stats import mean_ci95, t_test_p

    mean, low, high = mean_ci95(values)
    return {"mean": mean, "ci95": [low, high], "p": t_test_p(values), "n": len(values)}
