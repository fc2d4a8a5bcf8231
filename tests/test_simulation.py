"""Whole runs of every baseline on tiny random-init models: they learn.

(#40: the runs go through ``inprocess.run``: the ServerApp's run_server with Postcard's ClientApp answering
in this process, the same metrics as the Ray simulation and ``flwr run`` to the bit (test_flwr_run), without
Ray's start per run. Flower's runtime: test_flwr_run, test_demo, test_cli, test_hostile_run, test_deploy.)

(#40: the LoRA payload sizes, exact r·(d_in + d_out) fp32 bytes per target and B only for FFA-LoRA,
are checked on the fedavg-lora and ffa-lora runs here; the separate ffa-lora run that checked them,
test_lora_payload_sizes_follow_the_algorithm, is cut: ~60 s.)
"""

import pytest

from fedapps.config import compose
from fedapps.final import load_run
from fedapps.outputs import mean_train_loss, read_metrics
from inprocess import run as simulate

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("algorithm, secure", [("fedavg-lora", False), ("ffa-lora", True), ("fedavg-full", False)])
def test_baseline_learns_over_three_rounds(algorithm, secure, outputs):
    """fedprox: test_strategy (its term); ffa-lora runs under secure aggregation (masked updates) and
    central differential privacy (clipped updates, seeded noise on their unmasked sum)."""
    extra = ["privacy.mode=central", "privacy.noise_multiplier=0.01", "privacy.clip=10", "privacy.seed=3"]
    cfg = compose([f"secure_aggregation.enabled={str(secure).lower()}", *(extra if secure else [])],
                  preset="test", algorithm=algorithm)
    summary = simulate(cfg)
    rounds = read_metrics(summary["run_dir"])
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert summary["refused_replies"] == 0
    if algorithm != "fedavg-full":  # LoRA: r·(d_in + d_out) fp32 values per target; FFA-LoRA sends B only (r·d_out)
        assert summary["uplink_bytes_per_client_round"] == lora_uplink_bytes(cfg, b_only=algorithm == "ffa-lora")
    if secure:  # every round unmasked the sum of both clients' updates
        assert all(r["secure"]["uploaded"] == 2 and r["secure"]["bits"] == 16 for r in rounds[1:])
        assert all(c["secagg_uplink_bytes"] > 0 for r in rounds[1:] for c in r["clients"])
        assert [r["privacy"]["rounds_released"] for r in rounds[1:]] == [1, 2, 3]
        assert summary["privacy"]["epsilon"] == rounds[3]["privacy"]["epsilon"] > rounds[1]["privacy"]["epsilon"]
    # loss falls: training loss from round 1 to 3 (a private run keeps none per client: its clients send
    # none), held-out perplexity from round 0 to 3
    if secure:
        reported = {k for r in rounds[1:] for c in r["clients"] for k in c
                    if k.startswith(("train_", "eval_")) and not k.endswith("_bytes")}
        assert reported == set(), reported
    else:
        assert mean_train_loss(rounds[3]) < mean_train_loss(rounds[1])
    assert rounds[3]["eval"]["perplexity"] < rounds[0]["eval"]["perplexity"]
    # every client sent exactly the federated tensors, every round
    ups = {c["uplink_payload_bytes"] for r in rounds[1:] for c in r["clients"]}
    assert len(ups) == 1 and ups.pop() == summary["uplink_bytes_per_client_round"]
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "metrics.png"):
        assert (outputs / summary["run_dir"].split("/")[-1] / name).exists()
    # the final model, rebuilt from the run folder alone, scores what the run recorded
    final = load_run(summary["run_dir"])
    assert final.evaluate()["aggregate"]["perplexity"] == pytest.approx(summary["final_metric"], rel=1e-6)
    if algorithm == "fedavg-lora":
        # adapter/ is a PEFT adapter: PeftModel on the backbone gives client 0's final metric
        from peft import PeftModel

        from clients.models.llm import load_causal_lm
        from clients.tasks import make_task
        from clients.train import evaluate

        base, tok = load_causal_lm(cfg.model, seed=int(cfg.seed))
        peft_model = PeftModel.from_pretrained(base, f"{summary['run_dir']}/adapter")
        metrics = evaluate(peft_model, make_task(cfg, 0, 2, tok), cfg.eval)
        assert metrics["perplexity"] == pytest.approx(summary["final_client_metrics"]["0"], rel=1e-4)
        # merged into a plain Hugging Face checkpoint: the same logits
        import torch
        from transformers import AutoModelForCausalLM

        ids = final.tokenizer("To be, or not to be", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected = final.model(ids).logits
            merged = AutoModelForCausalLM.from_pretrained(final.export(outputs / "merged"))
            assert torch.allclose(merged(ids).logits, expected, atol=1e-4)
        assert isinstance(final.generate("To be", max_new_tokens=3), str)


def lora_uplink_bytes(cfg, b_only: bool) -> int:
    """fp32 bytes of the LoRA factors of every target Linear of the run's model: r·(d_in + d_out) each,
    r·d_out for B alone. (Was a run of its own, test_lora_payload_sizes_follow_the_algorithm: the
    fedavg-lora and ffa-lora runs above check it now; SmolLM2's figure: test_flwr_run.)"""
    import torch

    from clients.models.llm import load_causal_lm

    model, _ = load_causal_lm(cfg.model, seed=int(cfg.seed))
    targets = set(cfg.algorithm.lora.target_modules)
    linears = [m for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    assert linears, targets
    r = int(cfg.algorithm.lora.r)
    return sum(r * (m.out_features + (0 if b_only else m.in_features)) * 4 for m in linears)


@pytest.mark.parametrize("algorithm, payload, extra", [
    ("fedavg-full", "fp32", ["algorithm.eval_local=true"]), ("fedavg-full", "int4", []),
    ("topk-ef", "topk", ["algorithm.compression.topk_fraction=0.1"]),  # 1% needs more than 3 short rounds
    ("powersgd", "powersgd", ["algorithm.compression.powersgd_rank=8"]),
])
def test_vision_full_weight_updates_learn_compressed_or_not(algorithm, payload, extra, outputs):
    """FLITE's baselines: full fine-tuning whose updates travel in fp32, int4, top-k+EF or PowerSGD."""
    from strategies.compress import max_nbytes

    cfg = compose(
        ["model=tiny-cnn", "partition=iid", "rounds=3", "train.local_steps=10", "train.batch_size=32",
         "train.lr=3e-3", "eval.max_batches=4", "eval.batch_size=64", "task.max_examples=2000",
         f"algorithm.payload={payload}", "num_clients=2", *extra],
        task="fmnist", algorithm=algorithm, preset="none",
    )
    summary = simulate(cfg)
    assert summary["refused_replies"] == 0
    assert summary["final_metric"] > summary["initial_metric"] + 0.1
    from fedapps.baselines import prepare

    model, _, extra = prepare(cfg)
    layout = {n: tuple(p.shape) for n, p in model.named_parameters() if n in extra["names"]}
    comp = cfg.algorithm.compression or {}
    expected = max_nbytes(layout, payload, fraction=comp.get("topk_fraction"), rank=comp.get("powersgd_rank"))
    assert summary["uplink_bytes_per_client_round"] == expected
    if cfg.algorithm.eval_local:  # each client scored its own model before aggregation (the aggregation drop)
        last = read_metrics(summary["run_dir"])[-1]
        assert all(0 <= c["train_local-accuracy"] <= 1 for c in last["clients"])
