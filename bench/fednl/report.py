"""The report: every section's tables (markdown) from a results dict."""

from __future__ import annotations

import json
import re

from .runs import MMLU_CLIENTS
from .stats import drop_interval


def label_of(key: str, stream_result: dict) -> str:
    return stream_result.get("label") or ("FedNL recurrent" if key == "fednl" else "fedavg-lora + KV cache")


def fmt_bytes(value) -> str:
    return "—" if value is None else f"{value:,.0f}"


def run_date(results: dict) -> str:
    """The day a result was made: its own ``date``, else the newest dated run folder it names
    (``.../YYYYMMDD-HHMMSS/...``: results made before the date was recorded)."""
    if results.get("date"):
        return str(results["date"])
    stamps = re.findall(r"/(\d{4})(\d{2})(\d{2})-\d{6}(?:/|\b)", json.dumps(results, default=str))
    return "-".join(max(stamps)) if stamps else "date not recorded"


def section_times(seconds: dict) -> str:
    """The line under a report: how long each section took."""
    return "\nSection times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items()) + "\n"


def report(args, results: dict, command: str) -> str:
    from postcard.compare import wilson

    only_retrieval = "retrieval" in results and not set(results) & {"mmlu", "niah", "stream", "lm", "passkey"}
    seeds = (f"seeds {', '.join(str(x) for x in args.retrieval_seeds)}" if only_retrieval
             else f"seed {args.seed}")  # the retrieval section has seeds of its own
    lines = [f"Command: `{command}`", "",
             f"Model: {args.model}; {seeds}; {run_date(results)}; "
             f"total {results.get('seconds', 0) / 60:.1f} min on this machine.", ""]
    mmlu = results.get("mmlu")
    if mmlu:
        q = next(iter(mmlu.values()))["test_questions_per_client"]
        lines += [f"### MMLU, 5 clients (one super-category each), {args.rounds} rounds x {args.local_steps} steps, "
                  f"{q} test questions per client", "",
                  "| algorithm | " + " | ".join(MMLU_CLIENTS) + " | average | round 0 | uplink B/client/round | "
                  "downlink B/client/round |",
                  "|---|" + "---:|" * (len(MMLU_CLIENTS) + 4)]
        for spec, r in mmlu.items():
            cells = [f"{r['per_client'].get(c, float('nan')):.3f}" for c in MMLU_CLIENTS]
            initial = "—" if r["initial"] is None else f"{r['initial']:.3f}"
            lines.append(f"| {spec} | " + " | ".join(cells) + f" | {r['average']:.3f} | {initial} | "
                         f"{fmt_bytes(r['uplink_bytes'])} | {fmt_bytes(r['downlink_bytes'])} |")
        lines += ["", "Aggregation drop (client's own model before aggregation minus the federated model, "
                      f"accuracy on the same {q} test questions per client, last round; positive = aggregation lost "
                      "accuracy). The 95% interval of the mean is over the pooled questions, unpaired (the clients "
                      "report accuracies, not answers: wider than a paired interval when the two models agree "
                      "on most questions):", "",
                  "| algorithm | " + " | ".join(MMLU_CLIENTS) + " | mean (95% CI) |",
                  "|---|" + "---:|" * (len(MMLU_CLIENTS) + 1)]
        for spec, r in mmlu.items():
            if r["aggregation_drop"]:
                drops = [r["aggregation_drop"].get(c) for c in MMLU_CLIENTS]
                mean, low, high = drop_interval(r, q)
                lines.append(f"| {spec} | " + " | ".join(f"{d:+.3f}" for d in drops) +
                             f" | {mean:+.3f} ({low:+.3f}..{high:+.3f}) |")
        lines.append("")
        for spec, r in mmlu.items():
            if r.get("ala_weights"):
                settings = {}  # the effective value of each ALA key (a later override replaces the caps)
                for o in r.get("overrides", []):
                    if o.startswith("algorithm.ala."):
                        settings[o.split("=", 1)[0]] = o
                settings = list(settings.values())
                lines += [f"{spec}'s ALA weights after each round's ALA ({', '.join(settings) or 'its defaults'}), "
                          "min / mean / max over the clients and elements: "
                          + "; ".join(f"round {w['round']}: {w['min']:.4f} / {w['mean']:.4f} / {w['max']:.4f}"
                                      for w in r["ala_weights"]) + ".", ""]
    if results.get("mmlu_paired"):
        lines += paired_lines(results["mmlu_paired"])
    niah = results.get("niah")
    if niah:
        lengths = [str(x) for x in args.niah_lengths]
        counts = next(iter(niah.values()))["test_prompts_per_length"]
        lines += [f"### NIAH, 7 clients (one template each), {args.niah_rounds} round(s) x {args.niah_steps} steps on "
                  f"{args.niah_train_length}-token prompts; accuracy of the final global model "
                  f"({', '.join(f'{counts[k]} prompts at {k}' for k in lengths if k in counts)})", "",
                  "Accuracy (95% Wilson interval) per test length; the train loss is the clients' mean cross-entropy "
                  "of the answer letter over the full vocabulary, at the first step and in the last round.", "",
                  "| algorithm | " + " | ".join(f"{x} tokens" for x in lengths) + " | train loss first → last "
                  "| α at the end |",
                  "|---|" + "---:|" * (len(lengths) + 2)]
        for name, r in niah.items():
            label = {"fednl": f"fednl (window {args.window})",
                     "fednl-ablate": f"fednl ablation, memory off (window {args.window})"}.get(name, name)
            cells = []
            for x in lengths:
                acc, n = r["per_length"].get(x), r["test_prompts_per_length"].get(x, 0)
                if acc is None or not n:
                    cells.append("—")
                    continue
                low, high = wilson(round(acc * n), n)
                cells.append(f"{acc:.3f} ({low:.2f}..{high:.2f})")
            loss = r.get("train_loss") or []
            trend = f"{loss[0]:.3f} → {loss[-1]:.3f}" if len(loss) > 1 else "—"
            alpha = r.get("alpha") if name != "fednl-ablate" else None  # the ablation's gate does nothing
            a = f"mean {sum(alpha) / len(alpha):.3f}, max {max(alpha):.3f}" if alpha else "—"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {trend} | {a} |")
        lines.append("")
        paired = results.get("niah_paired") or {}
        if paired:
            lines += ["FedNL paired against each reference on the same prompts (difference in accuracy, 95% interval, "
                      "McNemar's exact p; prompts FedNL got right and the reference wrong / the reverse; the "
                      "answer letter's cross-entropy, paired prompt by prompt, 95% t-interval):", "",
                      "| length | reference | FedNL − reference | McNemar p | gained / lost | letter CE, FedNL − reference |",
                      "|---:|---|---:|---:|---:|---:|"]
            for length, refs in paired.items():
                for ref, d in refs.items():
                    ce = d.get("loss_diff")
                    ce = f"{ce['mean']:+.4f} ({ce['ci95'][0]:+.4f}..{ce['ci95'][1]:+.4f})" if ce else "—"
                    lines.append(f"| {length} | {ref} | {d['mean'] * 100:+.1f} pp ({d['ci95'][0] * 100:+.1f}.."
                                 f"{d['ci95'][1] * 100:+.1f}) | {d['p_value']:.3g} | "
                                 f"{d['other_right_ref_wrong']} / {d['ref_right_other_wrong']} | {ce} |")
            lines.append("")
    stream = results.get("stream")
    if stream:
        lengths = [str(x) for x in args.memory_lengths]
        trained = {"niah": "the NIAH section's trained models", "lm": "the lm section's trained models"}.get(
            args.stream_from, "untrained models")
        lines += [f"### Streaming a {args.stream_length}-token NIAH prompt in blocks of {args.block} ({trained})", "",
                  "Peak inference memory above the loaded model (MB) at each context length, and the carried state:", "",
                  "| model | " + " | ".join(lengths) + f" | growth {lengths[0]}→{lengths[-1]} | carried state at {lengths[-1]} |",
                  "|---|" + "---:|" * (len(lengths) + 2)]
        for key, r in stream.items():
            peaks = [r["peak_bytes"].get(x) for x in lengths]
            growth = peaks[-1] / peaks[0] if peaks[0] else float("nan")
            lines.append(f"| {label_of(key, r)} | " + " | ".join(f"{p / 1e6:.1f}" for p in peaks) +
                         f" | {growth:.2f}x | {r['state_bytes'][lengths[-1]] / 1e6:.1f} MB |")
        lines += ["", f"Target: FedNL grows <= 1.1x from {lengths[0]} to {lengths[-1]} tokens.", "",
                  "Normalised cross-entropy per 1K-token bin relative to the first bin (% change; the last bin holds "
                  "the question and choices, so the second half's mean is the steadier figure):", "",
                  "| model | bins | second half vs first bin | last bin vs first bin |", "|---|---:|---:|---:|"]
        for key, r in stream.items():
            rel = r["relative_ce"]
            if len(rel) >= 2:
                half = rel[len(rel) // 2:]
                lines.append(f"| {label_of(key, r)} | {len(rel)} | {(sum(half) / len(half) - 1) * 100:+.1f}% | "
                             f"{(rel[-1] - 1) * 100:+.1f}% |")
        lines.append("")
    tp = results.get("throughput")
    if tp:
        rates = tp["tokens_per_second"]
        cpu = tp["tokens_per_cpu_second"]
        lines += [f"### Training throughput ({tp['batch']} x {tp['seq']} tokens, {tp['steps']} timed steps, "
                  f"{tp['threads']} threads, AdamW step included, chunk {tp['chunk_size']})", "",
                  "| model | trainable values | tokens/s (wall) | tokens per CPU-second |", "|---|---:|---:|---:|",
                  f"| FedNL (memory + LoRA q/k/v) | {tp['trainable']['fednl']:,} | {rates['fednl']:.1f} | {cpu['fednl']:.1f} |",
                  f"| plain LoRA q/k/v, same rank | {tp['trainable']['lora-qkv']:,} | {rates['lora-qkv']:.1f} | "
                  f"{cpu['lora-qkv']:.1f} |", "",
                  f"FedNL / plain LoRA = **{tp['ratio']:.2f}x** wall-clock, **{tp['cpu_ratio']:.2f}x** per CPU-second"
                  + ratio_sentence(tp, "fednl") + " (on a shared machine the CPU-time ratio is the steadier one).", ""]
        heads = [k for k in rates if k.startswith("fednl ") and not k.startswith("fednl chunk")]  # + variants
        ratios = tp.get("ratios", {})
        if heads or ratios:
            default = tp.get("memory_heads", "query")
            lines += ["FedNL's memory heads side by side (one memory per query head, or per key/value head) and "
                      "the --throughput-variants, timed in the same interleaved loop; the ratio to plain LoRA from the mean step times and, "
                      "round by round, its median and range:", "",
                      "| model | trainable values | tokens/s (wall) | tokens per CPU-second | / LoRA wall (median, "
                      "range) | / LoRA CPU (median, range) | ≥ 0.9x? (wall, rounds' 95% t) |", "|---|---:|---:|---:|---:|---:|---|"]
            for key in ["lora-qkv", "fednl", *heads]:
                name = {"lora-qkv": "plain LoRA q/k/v", "fednl": f"FedNL, memory_heads={default} (default)"}.get(
                    key, f"FedNL, {key[6:]}")
                cells = []
                for which in ("wall", "cpu"):
                    r = ratios.get(key, {}).get(which)
                    cells.append("1" if key == "lora-qkv" else
                                 f"**{r['mean']:.2f}x** ({r['median']:.2f}, {r['min']:.2f}..{r['max']:.2f})" if r else "")
                verdict = "" if key == "lora-qkv" else ratio_cell(tp, key)
                lines.append(f"| {name} | {tp['trainable'][key]:,} | {rates[key]:.1f} | {cpu[key]:.1f} | "
                             f"{cells[0]} | {cells[1]} | {verdict} |")
            load = tp.get("load_average")
            if load:
                lines.append("")
                lines.append("Load average (1, 5, 15 min) before and after the timed loop: "
                             + " -> ".join(", ".join(f"{x:.2f}" for x in la) for la in load) + ".")
            lines.append("")
        chunks = [k for k in rates if k.startswith("fednl chunk")]
        if chunks:
            lines += ["Other chunk sizes of the training-time delta rule, timed in the same loop:", "",
                      "| model | tokens/s (wall) | tokens per CPU-second | / plain LoRA (CPU) |", "|---|---:|---:|---:|"]
            lines += [f"| FedNL, {k[6:]} | {rates[k]:.1f} | {cpu[k]:.1f} | {cpu[k] / cpu['lora-qkv']:.2f}x |"
                      for k in chunks]
            lines.append("")
        prof = tp.get("profile")
        if prof:
            a, b = prof["models"]
            lines += [f"Where the extra time goes: self CPU time per operator, ms per step (torch.profiler, 2 steps each; "
                      f"totals {prof['total_ms'][a]:,.0f} ms {a} vs {prof['total_ms'][b]:,.0f} ms {b}, profiler "
                      "overhead included), the operators with the largest difference:", "",
                      f"| operator | {a} ms (calls) | {b} ms (calls) | difference ms |", "|---|---:|---:|---:|"]
            for row in prof["ops"]:
                (ms_a, n_a), (ms_b, n_b) = row[a], row[b]
                lines.append(f"| `{row['op'][:60]}` | {ms_a:,.1f} ({n_a}) | {ms_b:,.1f} ({n_b}) | {ms_a - ms_b:+,.1f} |")
            lines.append("")
    if results.get("lm"):
        lines += lm_lines(results["lm"])
    return "\n".join(lines)


def paired_lines(paired: dict) -> list[str]:
    from bench import protocol

    from .runs import round0_of

    margin = paired["margin"]
    lines = [f"### MMLU, paired on {paired['items']:,} held-out questions (every client's, never trained on)", "",
             "Accuracy with its 95% Wilson interval; against fedavg-lora the paired difference (95% interval), "
             f"McNemar's exact p, the one-sided non-inferiority p at a {margin * 100:g}-point margin "
             "(p < 0.05: not worse by that much) and the verdict by the protocol's one rule (`bench/protocol.py`: "
             f"the interval's lower bound against −{margin * 100:g} pp; *uninformative* when the model's own round 0, "
             "untrained, is within the margin too); *moved* is the final model against its own round 0.", "",
             "| model | accuracy (95% CI) | Δ vs fedavg-lora (95% CI) | McNemar p | non-inferiority p | verdict | "
             "moved from round 0 (95% CI) | McNemar p |", "|---|---|---|---|---|---|---|---|"]
    versus = paired.get("vs_fedavg_lora", {}).get("runs", {})
    for name, acc in paired["accuracy"].items():
        row = f"| {name} | {acc['accuracy']:.3f} ({acc['ci95'][0]:.3f}..{acc['ci95'][1]:.3f}) | "
        d = versus.get(name, {}).get("accuracy_diff")
        untrained = versus.get(f"round 0: {round0_of(name)}", {}).get("accuracy_diff")
        verdict = (protocol.verdict(d["mean"] * 100, [v * 100 for v in d["ci95"]], -margin * 100,
                                    no_training=untrained["mean"] * 100)
                   if d and untrained and not name.startswith("round 0") else "—")
        row += (f"{d['mean'] * 100:+.1f} pp ({d['ci95'][0] * 100:+.1f}..{d['ci95'][1] * 100:+.1f}) | {d['p_value']:.3g} | "
                f"{d['noninferior_p']:.3g} | {verdict} | " if d else "— | — | — | — | ")
        m = paired["moved"].get(name, {}).get("accuracy_diff")
        row += (f"{m['mean'] * 100:+.1f} pp ({m['ci95'][0] * 100:+.1f}..{m['ci95'][1] * 100:+.1f}) | {m['p_value']:.3g} |"
                if m else "— | — |")
        lines.append(row)
    ablation = paired.get("vs_ablation", {}).get("runs", {})
    for name, r in ablation.items():
        d = r.get("accuracy_diff")
        if d:
            lines.append("")
            lines.append(f"{name} − its ablation (memory off): {d['mean'] * 100:+.1f} pp "
                         f"({d['ci95'][0] * 100:+.1f}..{d['ci95'][1] * 100:+.1f}), McNemar p {d['p_value']:.3g} "
                         f"({d['other_right_ref_wrong']} questions gained, {d['ref_right_other_wrong']} lost).")
    for base, cmp in paired.get("fednl_vs_baselines", {}).items():
        for name, r in cmp["runs"].items():
            d = r.get("accuracy_diff")
            if d:
                lines.append("")
                lines.append(f"{name} − {base}: {d['mean'] * 100:+.1f} pp ({d['ci95'][0] * 100:+.1f}.."
                             f"{d['ci95'][1] * 100:+.1f}), McNemar p {d['p_value']:.3g}, non-inferiority p "
                             f"{d['noninferior_p']:.3g} ({d['other_right_ref_wrong']} questions gained, "
                             f"{d['ref_right_other_wrong']} lost).")
    return lines + [""]


def ratio_cell(tp: dict, key: str) -> str:
    """``key``'s round-by-round wall-clock ratio to plain LoRA: its 95% t interval and verdict (≥ 0.9x)."""
    from .throughput import round_ratio

    if "step_seconds" not in tp or key not in tp["step_seconds"]:
        return ""
    r = round_ratio(tp, key, "wall")
    return (f"{r['ci95'][0]:.2f}..{r['ci95'][1]:.2f}: **{r['verdict']}**" if r["ci95"] else f"**{r['verdict']}**")


def ratio_sentence(tp: dict, key: str) -> str:
    from .throughput import TARGET_RATIO, round_ratio

    if "step_seconds" not in tp:  # an earlier run's JSON: the mean alone, which is never "met"
        from bench import protocol

        verdict = protocol.verdict(tp["ratio"] - 1, None, TARGET_RATIO - 1, kind="non-inferiority")
        return f" (target >= {TARGET_RATIO}x: no per-round times recorded, the mean alone: {verdict})"
    parts = []
    for which in ("wall", "cpu"):
        r = round_ratio(tp, key, which)
        parts.append(f"{which} {r['mean']:.2f}x" + (f" ({r['ci95'][0]:.2f}..{r['ci95'][1]:.2f})" if r["ci95"] else "")
                     + f": {r['verdict']}")
    return (f"; round by round over {r['rounds']} rounds, 95% t, against the target >= {TARGET_RATIO}x (the interval's "
            "lower bound must reach it): " + "; ".join(parts))


def lm_lines(lm: dict) -> list[str]:
    import math

    import numpy as np

    lines = [f"### Language modelling past a {lm['window']}-token window (Shakespeare, 4 clients, "
             f"{lm['rounds']} rounds x {lm['steps']} steps)", "",
             f"Mean held-out loss (nats per token) over {lm['windows']} windows of {lm['seq']} tokens, every client's; "
             "Δ is paired window by window (95% t-interval, paired t p).", "",
             "| model | loss | perplexity | Δ vs FedNL's ablation (95% CI), p | Δ vs fedavg-lora (95% CI), p | α at the end |",
             "|---|---:|---:|---|---|---|"]

    def delta(d):
        return f"{d['mean']:+.4f} ({d['ci95'][0]:+.4f}..{d['ci95'][1]:+.4f}), p {d['p_value']:.3g}" if d else "—"

    for name, loss in lm["loss"].items():
        alpha = (lm["runs"].get(name) or {}).get("alpha")
        a = f"mean {np.mean(alpha):.3f}, max {np.max(alpha):.3f}" if alpha else "—"
        lines.append(f"| {name} | {loss:.4f} | {math.exp(min(loss, 50)):.2f} | "
                     f"{delta(lm.get('vs_ablation', {}).get(name))} | {delta(lm.get('vs_fedavg_lora', {}).get(name))} "
                     f"| {a} |")
    loss = lm["loss"]
    if {"fednl", "fednl-ablate", "fedavg-lora"} <= set(loss) and loss["fednl-ablate"] > loss["fedavg-lora"]:
        share = (loss["fednl-ablate"] - loss["fednl"]) / (loss["fednl-ablate"] - loss["fedavg-lora"])
        lines += ["", f"Share of the loss the window costs (FedNL's ablation → fedavg-lora with full attention) that "
                      f"the memory recovers: {share * 100:.0f}%" + (" (none: FedNL is behind its ablation)."
                                                                    if share < 0 else ".")]
    return lines + [""]
