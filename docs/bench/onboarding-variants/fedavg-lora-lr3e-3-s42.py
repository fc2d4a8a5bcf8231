"""FedAvg-LoRA at lr 3e-3 on the onboarding protocol, seed 42 (docs/smartfed.md, "Fairness")."""
import json, sys
sys.path.insert(0, ".")  # run from the repository root
from fedapps.config import compose
from fedapps.simulation import simulate
ov = "model=smollm2 output_dir=/tmp/runs/onboarding-lora3e3 task=shakespeare rounds=8 num_clients=4 train.local_steps=10 train.lr=0.003 eval.max_batches=4 seed=42 run_name=onboarding-fedavg-lora-lr3e-3-s42".split()
s = simulate(compose(ov, algorithm="fedavg-lora"))
print("SUMMARY", json.dumps({k: s[k] for k in ("metric_by_round", "run_dir")}))
