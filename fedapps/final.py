"""A finished run's final global model, outside any run: load, evaluate, generate, export.

    from fedapps.final import load_run
    final = load_run("outputs/<run folder>")     # final.model (eval mode, CPU), final.tokenizer, final.cfg
    final.generate("To be, or not to be")        # causal LMs
    final.evaluate()                             # the run's held-out evaluation, every client's split
    final.export("merged/")                      # a standalone checkpoint (where a merge is exact)

Every method rebuilds its model from the run's own ``config.yaml`` (the resolved
configuration, seeds included) and what its ``save_final`` wrote (``Method.restore``):
LoRA methods their PEFT adapter, full-weight methods their weights, FLITE its latents
(factors regenerated from the seed, fingerprint checked), FedNL its meta-rules θ, SmartFed
its experts and active sets. ``postcard generate / evaluate / export`` are the commands.

An export is exact or refused: LoRA adapters and FLITE's ``θ_pre + U Vᵀ z`` merge into
the base weights (a Hugging Face checkpoint for a causal LM, loadable with
``AutoModelForCausalLM.from_pretrained``; a state-dict ``model.safetensors`` for a vision
model, loadable with ``model.path=``). FedNL's delta-rule memory belongs to no Hugging Face
architecture and SmartFed routes each token to its own experts, so neither merges into
static weights: use :func:`load_run` for them. Each method's record says which
(``Method.export``: its own merge, or why it cannot be exported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fedapps.filemodes import private_dir, private_file, secure_tree
from fedapps.method import FinalStateError


@dataclass
class FinalModel:
    """A run's final global model (eval mode, on the CPU) with its tokenizer and configuration."""

    model: torch.nn.Module
    tokenizer: object
    cfg: object
    run_dir: Path
    summary: dict

    def _client_tasks(self):
        """(partition id, number of clients, task) for each client's held-out split, as in the run."""
        from clients.tasks import make_task
        from fedapps.resolved import client_count

        n = client_count(self.cfg)
        for pid in range(n):
            yield pid, n, make_task(self.cfg, pid, n, self.tokenizer)

    def evaluate(self, progress=None) -> dict:
        """The run's evaluation of this model: each client's held-out split (``eval.*`` as in the run),
        aggregated as the server does (weighted by examples, capped by ``robust``). Returns
        ``{"clients": [metrics per partition], "aggregate": {...}}``."""
        from clients.train import evaluate as evaluate_model
        from strategies.screening import NUM_EXAMPLES, aggregate_metrics
        from strategies.robust import Robustness, cap_weights
        from omegaconf import OmegaConf

        per_client = []
        for pid, n, task in self._client_tasks():
            metrics = evaluate_model(self.model, task, self.cfg.eval)
            metrics["partition-id"] = pid
            per_client.append(metrics)
            if progress is not None:
                progress(pid, n, metrics)
        robustness = Robustness.from_mapping(OmegaConf.to_container(self.cfg.robust, resolve=True))
        weights = cap_weights([m[NUM_EXAMPLES] for m in per_client], robustness)
        return {"clients": per_client, "aggregate": dict(aggregate_metrics(per_client, weights))}

    def items(self, progress=None) -> dict:
        """Per held-out item of every client (the items :meth:`evaluate` scores): ``client``,
        ``index`` (into that client's task examples), ``loss`` and, for accuracy tasks,
        ``correct``. Kept in the run folder as ``items-<key>.npz``, one file per key of the task,
        evaluation and partition settings, client count and seed: scoring the run again with other
        settings adds a file and never replaces one made with others."""
        import hashlib

        import numpy as np
        from omegaconf import OmegaConf

        from fedapps.resolved import client_count

        n = client_count(self.cfg)
        settings = {k: OmegaConf.to_container(self.cfg[k], resolve=True) for k in ("task", "eval", "partition")}
        key = hashlib.sha256(json.dumps([settings, n, int(self.cfg.seed)], sort_keys=True).encode()).hexdigest()[:16]
        cache = self.run_dir / f"items-{key}.npz"
        for path in (cache, self.run_dir / "items.npz"):  # items.npz: the single file of earlier versions
            if path.is_file():
                with np.load(path) as saved:
                    if str(saved["key"]) == key:
                        return {k: saved[k] for k in saved.files if k != "key"}
        parts = []
        for pid, n, task in self._client_tasks():
            scores = task.items(self.model, int(self.cfg.eval.batch_size), int(self.cfg.eval.max_batches))
            scores["client"] = np.full(len(scores["index"]), pid, dtype=np.int64)
            parts.append(scores)
            if progress is not None:
                progress(pid, n, len(scores["index"]))
        out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        try:
            np.savez(cache, key=key, **out)
            private_file(cache)
        except OSError:  # a read-only run folder: the items are just not kept
            pass
        return out

    def generate(self, prompt: str, max_new_tokens: int = 40, *, greedy: bool = True, seed: int = 0) -> str:
        """The model's continuation of ``prompt`` (causal LMs; greedy unless ``greedy=False``)."""
        if self.cfg.model.kind != "causal_lm":
            raise FinalStateError(f"generate needs a causal LM; this run's model '{self.cfg.model.name}' is "
                                  f"{self.cfg.model.kind}")
        torch.manual_seed(seed)
        inputs = self.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=int(max_new_tokens), do_sample=not greedy,
                                      pad_token_id=self.tokenizer.eos_token_id)
        return self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    def export(self, target: str | Path) -> Path:
        """Write the merged model to ``target`` (see the module docstring); returns the folder.

        The model in memory is merged in place: load the run again to use it unmerged."""
        from fedapps import registry

        name = str(self.cfg.algorithm.name)
        export = registry.get(name).export
        if isinstance(export, str):
            raise FinalStateError(f"{name} cannot be exported as static weights: {export}; load it with "
                                  f"fedapps.final.load_run('{self.run_dir}')")
        target = Path(target).expanduser().resolve()
        if target.exists() and any(target.iterdir()):
            raise FinalStateError(f"{target} exists and is not empty; give a new folder")
        model = self.model
        if export is not None:  # the method's own merge
            model = export(model)
        elif hasattr(model, "merge_and_unload"):  # a PEFT model
            model = model.merge_and_unload()
        private_dir(target)
        if self.cfg.model.kind == "causal_lm":
            model.save_pretrained(str(target))
            self.tokenizer.save_pretrained(str(target))
        else:
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                      str(target / "model.safetensors"))
        (target / "postcard-export.json").write_text(json.dumps({
            "run_dir": str(self.run_dir), "algorithm": name, "task": str(self.cfg.task.name),
            "model": str(self.cfg.model.name), "final_metric": self.summary.get("final_metric"),
            "metric": str(self.cfg.task.metric)}, indent=1) + "\n")
        secure_tree(target)
        self.model = model
        return target


def load_run(run_dir: str | Path) -> FinalModel:
    """The final global model of a completed run folder (see the module docstring)."""
    from fedapps import registry
    from fedapps.resolved import from_yaml

    run_dir = Path(run_dir).expanduser().resolve()
    summary_path, config_path = run_dir / "summary.json", run_dir / "config.yaml"
    if not config_path.is_file():
        raise FinalStateError(f"{run_dir} is not a Postcard run folder (no config.yaml)")
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FinalStateError(f"{summary_path} cannot be read ({err})") from err
    if not isinstance(summary, dict):
        raise FinalStateError(f"{summary_path} is not a run summary (a JSON object)")
    if summary.get("status") != "completed":
        state = summary.get("status", "not finished")
        raise FinalStateError(f"{run_dir} holds no final model: the run is {state}"
                              + (f" ({summary['error']})" if summary.get("error") else ""))
    try:
        cfg = from_yaml(config_path.read_text())
    except Exception as err:  # noqa: BLE001 - any parse failure means the same to the user
        raise FinalStateError(f"{config_path} cannot be read as a run configuration ({type(err).__name__}: {err})") \
            from err
    try:
        model, tokenizer = registry.get(str(cfg.algorithm.name)).restore(cfg, run_dir)
    except FinalStateError:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: say so, not a deep traceback
        raise FinalStateError(f"{run_dir}: the final state cannot be read into this run's model "
                              f"({type(err).__name__}: {err})") from err
    model.to("cpu").eval()
    return FinalModel(model, tokenizer, cfg, run_dir, summary)
