"""The arms of bench/flite.py: each method as the benchmark runs it, the partitions, the reference and
the methods the byte and accuracy targets are about (bench/flite.py runs them, bench/flite_report.py
reports them)."""

# method -> (algorithm, overrides, default learning rate)
METHODS = {
    "flite-int4": ("flite", ["algorithm.payload=int4", "algorithm.downlink=int4"], 1e-2),
    "flite-fp32": ("flite", ["algorithm.payload=fp32", "algorithm.downlink=fp32"], 1e-2),
    "fedavg-full": ("fedavg-full", ["algorithm.payload=fp32"], 1e-4),
    "fedavg-full-int4": ("fedavg-full", ["algorithm.payload=int4"], 1e-4),
    "full-latent-int4": ("fedavg-full", ["channel=latent", "channel.format=int4", "channel.downlink=latent",
                                         "channel.downlink_format=fp32"], 1e-3),
    "fedavg-lora": ("fedavg-lora", [], 1e-3),
    "topk-ef": ("topk-ef", [], 1e-4),
    "powersgd": ("powersgd", [], 1e-4),
}
# the near regime's own defaults (docs/flite.md: chosen on seed 0, seeds 1-2 out of sample)
NEAR_LR = {"flite-int4": 3e-3}
PARTITIONS = {"dirichlet": ["partition=dirichlet", "partition.alpha=0.1"], "iid": ["partition=iid"]}
REFERENCE = "fedavg-full"
REPEATED = ("flite-int4", "fedavg-full", "full-latent-int4")  # the methods --seeds repeats
TINY = ("flite-int4", "full-latent-int4")  # the methods the byte and accuracy targets are about
TASKS = {"cifar10": "CIFAR-10", "fmnist": "Fashion-MNIST"}
BASES = {"model": "far regime: ImageNet MobileNetV2", "public": "near regime: θ_pre trained on the public split"}
