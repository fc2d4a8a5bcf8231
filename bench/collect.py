"""Write docs/benchmarks.md from the benchmark reports in docs/ (``make bench`` runs it last).

    .venv/bin/python bench/collect.py

Collects, in this order, whatever each benchmark script last wrote: ``docs/bench/demo/
demo.md`` (``python -m postcard.demo --report docs/bench/demo``), ``docs/bench/flite/
flite.md`` (bench/flite.py), ``docs/bench/flite-near/flite.md`` and ``docs/bench/flite-near-fmnist/flite.md``
(bench/flite.py --base public),
``docs/bench/wire_bytes.md``, ``docs/bench/lm_memory/lm_memory.md``, the bench section of ``docs/fednl.md`` (``python -m bench.fednl``'s
runs rendered with --write-docs), ``docs/bench/smartfed.md``, ``docs/bench/smartfed-int4/`` and ``docs/bench/smartfed-lr3/`` (bench/smartfed.py),
``docs/bench/onboarding/``, ``docs/bench/onboarding-tuned-topk4/``, ``docs/bench/onboarding-fair-topk4/``,
the earlier tuned setting's ``docs/bench/onboarding-lr3-int4x12/`` and ``docs/bench/onboarding-fair-lr3e-3/``
(bench/onboarding.py, in parts), ``docs/bench/lm_memory-tuned/`` and
``docs/bench/baseline_bytes.md`` (bench/baseline_bytes.py), ``docs/bench/fuzz_table.md`` and
``docs/bench/secagg/secagg.md`` (bench/secagg.py), ``docs/bench/privacy/privacy.md``
(bench/privacy.py), ``docs/bench/channels/channels.md`` (bench/channels.py), ``docs/bench/overhead/overhead.md``
and ``docs/bench/overhead-2nodes/overhead.md`` (bench/overhead.py), the FLITE protocol's
``docs/bench/flite-protocol-fmnist/{iid,dirichlet}/flite.md`` and SmartFed's
``docs/bench/smartfed-protocol/protocol-report.md`` (bench/smartfed_protocol.py). Each report carries the
command that made it; this page adds the machine facts and the date it was collected,
and says which report is missing.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# (title, report file, how to make it, section markers or None)
REPORTS = (
    ("Demo: the four methods on one task (`make demo`)", DOCS / "bench" / "demo" / "demo.md",
     "python -m postcard.demo --report docs/bench/demo", None),
    ("FLITE vs compressed-update baselines (CIFAR-10)", DOCS / "bench" / "flite" / "flite.md",
     "bench/flite.py", None),
    ("FLITE from a task-pretrained base (near regime, CIFAR-10)", DOCS / "bench" / "flite-near" / "flite.md",
     "bench/flite.py --base public --seeds 5 ... --out docs/bench/flite-near (see Makefile; made in parts: docs/flite.md)", None),
    ("FLITE from a task-pretrained base (near regime, Fashion-MNIST)", DOCS / "bench" / "flite-near-fmnist" / "flite.md",
     "bench/flite.py --base public --task fmnist ... then --merge (see Makefile; made in parts: docs/flite.md)", None),
    ("FLITE under the protocol (near regime, Fashion-MNIST, IID): tuned on validation, evaluated on other seeds",
     DOCS / "bench" / "flite-protocol-fmnist" / "iid" / "flite.md",
     "bench/flite.py --tune ... --out docs/bench/flite-protocol-fmnist (tuning.md), then --protocol "
     "docs/bench/flite-protocol-fmnist/protocol-iid.json --out docs/bench/flite-protocol-fmnist/iid (docs/flite.md)",
     None),
    ("FLITE under the protocol (near regime, Fashion-MNIST, Dirichlet 0.1): tuned on validation, evaluated on other seeds",
     DOCS / "bench" / "flite-protocol-fmnist" / "dirichlet" / "flite.md",
     "bench/flite.py --tune ... --partitions dirichlet --draft protocol-dirichlet.json, then --protocol "
     "docs/bench/flite-protocol-fmnist/protocol-dirichlet.json --out docs/bench/flite-protocol-fmnist/dirichlet "
     "(docs/flite.md)", None),
    ("FLITE under the protocol with headroom (θ_pre from a 1% public split, Fashion-MNIST, IID)",
     DOCS / "bench" / "flite-protocol-fmnist-headroom" / "iid" / "flite.md",
     "bench/flite.py --tune ... --out docs/bench/flite-protocol-fmnist-headroom -- task.public_fraction=0.01 "
     "(tuning.md), then --protocol docs/bench/flite-protocol-fmnist-headroom/protocol-iid.json "
     "--out docs/bench/flite-protocol-fmnist-headroom/iid (docs/flite.md)", None),
    ("A FLITE reply on the wire", DOCS / "bench" / "wire_bytes.md", "bench/wire_bytes.py", None),
    ("Causal-LM client memory: full logits vs the chunked output layer", DOCS / "bench" / "lm_memory" / "lm_memory.md",
     "bench/lm_memory.py", None),
    ("Causal-LM client memory: the frozen backbone in bf16 (SmartFed vs FedAvg-LoRA)",
     DOCS / "bench" / "lm_memory-bf16" / "lm_memory.md",
     "bench/lm_memory.py --methods smartfed --variants bf16 bf16+ckpt --seq-len 128", None),
    ("FedNL on SmolLM2 (MMLU, NIAH, memory, throughput)", DOCS / "fednl.md",
     "python -m bench.fednl, issue #15's protocol: make bench's FedNL lines, then --render ... --write-docs",
     ("<!-- bench:fednl:start -->", "<!-- bench:fednl:end -->")),
    ("SmartFed vs FedAvg-LoRA from scratch", DOCS / "bench" / "smartfed.md", "bench/smartfed.py", None),
    ("SmartFed, int4 uplink with 12 experts per matrix, vs FedAvg-LoRA", DOCS / "bench" / "smartfed-int4" / "smartfed.md",
     "bench/smartfed.py --smartfed-overrides ... --out docs/bench/smartfed-int4 (see Makefile)", None),
    ("SmartFed vs FedAvg-LoRA, both at lr 3e-3", DOCS / "bench" / "smartfed-lr3" / "smartfed.md",
     "bench/smartfed.py --lr 3e-3 --memory-steps 0 ... --out docs/bench/smartfed-lr3 (see Makefile)", None),
    ("SmartFed onboarding a new domain, 3 seeds × 4 clients × 8 rounds", DOCS / "bench" / "onboarding" / "onboarding.md",
     "bench/onboarding.py --clients 4 --rounds 8 --seed-list 42|43|44 ..., then --merge (made in parts: docs/smartfed.md)",
     None),
    ("SmartFed's tuned setting (preset=smartfed-tuned) onboarding, 3 seeds × 4 clients × 8 rounds",
     DOCS / "bench" / "onboarding-tuned-topk4" / "onboarding.md",
     "bench/onboarding.py --smartfed-overrides ... --seed-list 42|43|44, then --merge (see Makefile; docs/smartfed.md)",
     None),
    ("SmartFed tuned vs FedAvg-LoRA at lr 3e-3, onboarding, 3 seeds", DOCS / "bench" / "onboarding-fair-topk4" / "onboarding.md",
     "bench/onboarding.py --fedavg-lora-overrides train.lr=3e-3 ... (see Makefile; docs/smartfed.md)", None),
    ("SmartFed's earlier tuned setting (top_k 2) onboarding, 3 seeds", DOCS / "bench" / "onboarding-lr3-int4x12" / "onboarding.md",
     "bench/onboarding.py --smartfed-overrides ... then --merge (docs/smartfed.md)", None),
    ("SmartFed's earlier tuned setting (top_k 2) vs FedAvg-LoRA at lr 3e-3, 3 seeds",
     DOCS / "bench" / "onboarding-fair-lr3e-3" / "onboarding.md",
     "bench/onboarding.py --fedavg-lora-overrides train.lr=3e-3 ... (docs/smartfed.md)", None),
    ("SmartFed under the protocol: tuned on validation, evaluated on other seeds",
     DOCS / "bench" / "smartfed-protocol" / "protocol-report.md",
     "bench/smartfed_protocol.py --tune --seed-list 100 --out docs/bench/smartfed-protocol (tuning.json), then "
     "--protocol docs/bench/smartfed-protocol/protocol.json --out docs/bench/smartfed-protocol (in parts; "
     "docs/smartfed.md)", None),
    ("Client memory of SmartFed's tuned setting", DOCS / "bench" / "lm_memory-tuned" / "lm_memory.md",
     "bench/lm_memory.py --methods smartfed --smartfed-overrides ... --seq-len 128 (see Makefile)", None),
    ("Uplink bytes of the baselines", DOCS / "bench" / "baseline_bytes.md", "bench/baseline_bytes.py", None),
    ("Hostile replies: every kind through every strategy", DOCS / "bench" / "fuzz_table.md", "bench/fuzz_table.py",
     None),
    ("Secure aggregation: bytes and time", DOCS / "bench" / "secagg" / "secagg.md", "bench/secagg.py", None),
    ("Utility vs ε under central DP: latent updates vs full weights", DOCS / "bench" / "privacy" / "privacy.md",
     "bench/privacy.py", None),
    ("Method × channel: bytes and the metric", DOCS / "bench" / "channels" / "channels.md", "bench/channels.py", None),
    ("Flower's share of a round: simulation vs deployment", DOCS / "bench" / "overhead" / "overhead.md",
     "bench/overhead.py", None),
    ("Flower's share of a round with a core per node (2 nodes): simulation, stock Flower, warm worker",
     DOCS / "bench" / "overhead-2nodes" / "overhead.md",
     "bench/overhead.py --models smollm2 --clients 2 --out docs/bench/overhead-2nodes (docs/deploy.md section 9)", None),
    ("Flower's share of a round, five nodes on two cores, all three modes in one run",
     DOCS / "bench" / "overhead-5nodes" / "overhead.md",
     "bench/overhead.py --models smollm2 --clients 5 (report copied to docs/bench/overhead-5nodes; docs/deploy.md section 9)",
     None),
)


def machine() -> str:
    mem = ""
    try:
        with open("/proc/meminfo") as handle:
            kb = int(handle.readline().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        version = torch.__version__
    except ImportError:
        gpu, version = "torch not installed", "-"
    return f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores{mem}, {gpu}, torch {version}, " \
           f"Python {platform.python_version()}"


def section(path: Path, markers) -> str | None:
    if not path.is_file():
        return None
    text = path.read_text()
    if markers:
        match = re.search(re.escape(markers[0]) + r"(.*?)" + re.escape(markers[1]), text, re.S)
        return match.group(1).strip() if match else None
    return text.strip()


def rebase_images(text: str, source: Path) -> str:
    """Image links of a report relative to docs/ (where benchmarks.md lives)."""
    def fix(match):
        target = match.group(2)
        if re.match(r"^[a-z]+://", target) or target.startswith("/"):
            return match.group(0)
        return f"{match.group(1)}({os.path.relpath(source.parent / target, DOCS)})"

    return re.sub(r"(!\[[^\]]*\])\(([^)]+)\)", fix, text)


PROTOCOL = """## Protocol (issue #43; fixed 2026-12-04, before any re-run under it)

Every comparison between methods follows one protocol, in code in `bench/protocol.py`:
hyperparameters are chosen on a validation split carved from the clients' own training data,
never on test items; every arm gets the same tuning budget over a grid that brackets its best
value (the best may not sit at an edge); tuning seeds and evaluation seeds are disjoint, and the
tuned settings and evaluation seeds go into a protocol file committed before the evaluation
runs; every table has a no-training arm (round 0 / θ_pre) and a byte-matched baseline; and
"met" has one meaning — `protocol.verdict`: the 95% interval's bound clears a margin stated in
advance (non-inferiority at the margin, superiority strictly above it; one seed alone is at
most "not shown"), used by `bench/flite.py` and `bench/smartfed.py` alike. Given the no-training
arm's difference to the same baseline, a "met" that not training reaches too (its point estimate
clears the same bound) is "uninformative" (added 2026-12-05, after the results here were known:
it turned FLITE's CIFAR-10 Dirichlet row and FedNL's MMLU row from "met" to "uninformative").
`.venv/bin/python bench/protocol.py check PROTOCOL.json` refuses (exit 2, one line) a protocol
whose seeds overlap, whose best value sits at a grid edge, whose budgets differ, that was tuned
on the test split, states no margin, or lacks the no-training arm (tests/test_protocol.py).

The validation split is `task.eval_split=val` (image, Shakespeare and own-text tasks; passkey
has its own): a client keeps the same test items out of everything and scores `task.val_fraction`
of its training rows instead (`clients.partition.held_out_split`). For FLITE the workflow is in
`bench/flite.py`: `--tune` runs every `--lr-grid` value of every method on the tuning seeds
(`--seed-list`) on the validation split and drafts `protocol.json` (the best value per method and
partition, the evaluation seeds, the margin, θ_pre's sha256); once it passes the check it is
committed, and `--protocol protocol.json` evaluates under it, refusing a file that is not
committed as it is, and its report names that commit. For SmartFed, `bench/smartfed_protocol.py`
does the same over four arms (SmartFed's tuned preset, FedAvg-LoRA in fp32, in int4 — the
byte-matched baseline — and warm-started from the same pool, `algorithm.lora.init=pool`), records
the pool's sha256 and refuses another.
FedALA's step size η, which left its weights at 1 in the MMLU comparison, is chosen the same way by
`bench/fedala_eta.py` (validation split, a grid that must bracket the best, the weights' range reported).
Reports made under the protocol say so in their first lines (the commit of their protocol
file); the others were made before it existed: their tuning is described in each method's doc
(docs/flite.md, docs/smartfed.md, docs/fednl.md), and docs/results.md marks each claim.
"""


def main() -> int:
    lines = ["# Benchmarks", "",
             f"Collected by `bench/collect.py` on {time.strftime('%Y-%m-%d')} ({machine()}). `make bench` runs every "
             "benchmark script, then this one; each section below is the report its script last wrote, with the "
             "exact command (and settings) that made it.", "", PROTOCOL]
    for title, path, command, markers in REPORTS:
        text = section(path, markers)
        lines += [f"## {title}", ""]
        if text is None:
            lines += [f"_Not run yet_: `{command}` writes `{path.relative_to(ROOT)}`.", ""]
            continue
        text = re.sub(r"^# .*\n", "", text, count=1)  # the report's own title
        text = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)  # one level deeper
        lines += [f"Source: [{path.relative_to(DOCS)}]({path.relative_to(DOCS)}), made by `{command}`.", "",
                  rebase_images(text, path), ""]
    (DOCS / "benchmarks.md").write_text("\n".join(lines))
    print(f"wrote {DOCS / 'benchmarks.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
