"""``postcard``: run configurations in simulation from the command line (Hydra CLI).

    postcard algorithm=fedprox task=mmlu rounds=2            # one run
    postcard -m algorithm=fedavg-lora,fedprox,ffa-lora        # a sweep, then one table
    postcard -m train.lr=1e-4,1e-3 preset=test                # a sweep over any key: a column per key
    postcard --cfg job                                        # check and print the composed config (as the server runs it)
    postcard --config-dir DIR preset=mine                     # config groups of your own (DIR/preset/mine.yaml), after conf/
    postcard pool {build,add,list} ...                        # SmartFed's LoRA knowledge pool
    postcard convert --gguf FILE --out DIR                    # a GGUF causal LM as a HF checkpoint (model=hf model.path=DIR)
    postcard pretrain task=cifar10                            # θ_pre for base=public (a task-pretrained base)
    postcard generate RUN_DIR "To be, or not"                 # a finished run's final model: a continuation,
    postcard evaluate RUN_DIR                                 # its held-out evaluation,
    postcard export RUN_DIR merged/                           # a standalone checkpoint (postcard.final)
    postcard compare REF_RUN RUN ...                          # paired, item by item: 95% intervals, McNemar
    postcard link-budget RUN_DIR [--target X]                 # its rounds modelled on phone, home, data-centre links
    postcard supernode-worker --runtime-api-address H:P --insecure  # a warm node worker beside flower-supernode
                                                              #   --isolation process (postcard.worker)

Each run is ``flwr run`` of this app (a Flower simulation with Ray, through the checkout's
own local SuperLink: ``postcard.superlink``; stop it with ``make stop-superlink``) with
``num_clients`` SuperNodes (the task's default when unset) and writes its usual run folder;
``postcard`` exits 1 when a run fails. After a sweep, the folder of
the sweep gets ``comparison.md``, ``comparison.csv`` (one row per configuration, a column
per swept key) and ``comparison.png`` (metric against cumulative uplink bytes per client,
a curve per run). A bad key or choice stops it at once: one line, exit status 2.
``flwr run .`` runs the same configurations (``python -m postcard.app_run`` with an exit status).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from fedapps.config import CONF_DIR, GROUPS, ConfigError, choices, finalize
from fedapps.comparison import write_comparison

class ComparisonTable(Callback):
    """Hydra callback: collect each job's summary; write the table when the sweep ends."""

    def __init__(self) -> None:
        self.summaries: list[dict] = []

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        value = getattr(job_return, "_return_value", None)
        if isinstance(value, dict):
            self.summaries.append(value)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.summaries:
            write_comparison(self.summaries, Path(config.hydra.sweep.dir))


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def run(cfg: DictConfig) -> dict | None:
    from postcard.app_run import data_refusal, resume_refusal, run_composed

    try:
        cfg = finalize(cfg)
    except ConfigError as err:
        print(f"postcard: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    hydra_cfg = HydraConfig.get()
    _drop_empty(Path(hydra_cfg.runtime.output_dir))  # Hydra's own job folder: the run writes its own
    if hydra_cfg.mode.name == "MULTIRUN":  # each run's folder in the sweep's, named by what the sweep varies
        OmegaConf.set_struct(cfg, False)
        if cfg.output_dir is None:
            cfg.output_dir = str(Path(hydra_cfg.sweep.dir).resolve())
        if not cfg.get("run_name"):
            cfg.run_name = sweep_run_name(list(hydra_cfg.overrides.task), sys.argv[1:], hydra_cfg.job.num)
        OmegaConf.set_struct(cfg, True)
    # a resume folder without a checkpoint: refused now, not after the run has started (run_composed
    # sends the server this process's output root, so a relative folder means the same there)
    # and an image task whose dataset is not on this machine (CIFAR-10 without the bigbench sdist)
    refused = resume_refusal(cfg, relative=True) or data_refusal(cfg)
    if refused:
        print(f"postcard: {refused}", file=sys.stderr)
        raise SystemExit(2)
    status, summary = run_composed(cfg, list(HydraConfig.get().overrides.task), config_dirs(sys.argv[1:]))
    if status != 0:  # the run's own error has been printed by now
        raise SystemExit(status)
    return summary


SWEEP_FUNCTIONS = re.compile(r"^(range|choice|glob|interval)\(")  # Hydra's sweep syntax besides a,b,c


def sweep_run_name(job_overrides: list[str], argv: list[str], job_num: int) -> str:
    """A sweep job's run folder name: its values of the swept keys (``algorithm=ffa-lora,train.lr=0.001``),
    made safe for a file name; ``job-<n>`` when nothing is swept."""
    swept = set()
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and not arg.startswith("-") and ("," in value or SWEEP_FUNCTIONS.match(value)):
            swept.add(key.lstrip("+~"))
    parts = [o for o in job_overrides if o.partition("=")[0].lstrip("+~") in swept]
    name = re.sub(r"[^\w.,=+\-]+", "_", ",".join(parts)).lstrip(".")[:120]  # no path, quote or bracket
    return name or f"job-{job_num}"


def _drop_empty(folder: Path) -> None:
    try:
        folder.rmdir()  # only if empty
    except OSError:
        pass


def config_dirs(args: list[str]) -> list[str]:
    """The folder of ``--config-dir DIR`` (Hydra's ``-cd``, ``--config-dir=DIR``): config groups of the
    user's own, searched after ``conf/`` by this check, by Hydra, and by the server (run config
    ``config-dir``). Refused in one line when it is not a folder."""
    found = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config-dir", "-cd")]
    found += [a.split("=", 1)[1] for a in args if a.startswith("--config-dir=")]
    for folder in found:
        if not Path(folder).expanduser().is_dir():
            raise ConfigError(f"--config-dir '{folder}' is not a folder")
    return [str(Path(f).expanduser().resolve()) for f in found]


def _cfg_job(args: list[str]) -> bool:
    """``--cfg job`` (or ``-c job``, ``--cfg=job``) without Hydra's ``--package``/``--resolve`` options."""
    for i, arg in enumerate(args):
        if arg == "--cfg=job" or (arg in ("--cfg", "-c") and args[i + 1:i + 2] == ["job"]):
            return not any(a.startswith(("--package", "-p", "--resolve")) for a in args)
    return False


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "pool":  # SmartFed's knowledge pool
        from postcard.pool import main as pool_main

        raise SystemExit(pool_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "convert":  # a GGUF file -> a HF checkpoint folder
        from postcard.convert import main as convert_main

        raise SystemExit(convert_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "pretrain":  # θ_pre on the task's public split
        from postcard.pretrain import main as pretrain_main

        raise SystemExit(pretrain_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "link-budget":  # a run's rounds modelled on real links
        from fedapps.linkbudget import main as budget_main

        raise SystemExit(budget_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "compare":  # finished runs, paired item by item
        from postcard.compare import main as compare_main

        raise SystemExit(compare_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "supernode-worker":  # a SuperNode's warm ClientApp process
        from postcard.worker import main as worker_main

        raise SystemExit(worker_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] in ("generate", "evaluate", "export"):  # a finished run's final model
        from postcard.final import main as final_main

        raise SystemExit(final_main(sys.argv[1:]))
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        print("Groups:", ", ".join(f"{g} ({', '.join(choices(g))})" for g in GROUPS))
        print("Hydra's own options: postcard --hydra-help")
        return
    # keys and choices are checked before Hydra composes (its own advice for a misspelled key
    # is to add it with +key); Hydra's --cfg prints without running the job: validate it first
    from fedapps.config import check_overrides, compose

    args = sys.argv[1:]
    overrides = [arg for arg in args if "=" in arg and not arg.startswith("-")]
    try:
        conf_path = config_dirs(args)
        check_overrides(overrides, conf_path)
        multirun = any(arg in ("-m", "--multirun") for arg in args)
        if not multirun and any(arg in ("--cfg", "-c") or arg.startswith("--cfg=") for arg in args):
            composed = compose(overrides, conf_path=conf_path)
            if _cfg_job(args):  # what the server runs: checked and derived (templates, wire settings), resolved
                from fedapps.config import to_yaml

                print(to_yaml(composed), end="")
                return
    except ConfigError as err:
        print(f"postcard: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    run()


if __name__ == "__main__":
    main()
