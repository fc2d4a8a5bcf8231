"""base=public: the public split, θ_pre built once and reused, its head never re-drawn."""

import numpy as np
import pytest
import torch

from fedapps.config import ConfigError, compose

TINY = ["model=tiny-cnn", "base=public", "base.steps=12", "base.batch_size=16", "task.image_size=16",
        "num_clients=3"]

# each image task: CIFAR-10 (skipped without the bigbench sdist, tests/conftest.py) and Fashion-MNIST
DATASETS = [pytest.param("cifar10", marks=pytest.mark.needs_cifar10), "fmnist"]
# public images per class (20% of each), and the clients' pool (fmnist: task.max_examples of the rest)
PUBLIC = {"cifar10": (200, 8_000), "fmnist": (1_400, 10_000)}


@pytest.fixture(params=DATASETS)
def dataset(request):
    return request.param


@pytest.fixture
def cache(dataset, tmp_path, monkeypatch):
    """θ_pre goes to a temporary cache; the converted dataset is linked from the real one."""
    from clients.assets import cache_dir
    from clients.tasks.vision import dataset_file

    real = dataset_file(dataset).parent
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / real.name).symlink_to(real)
    monkeypatch.setenv("POSTCARD_CACHE", str(folder))
    assert cache_dir() == folder
    return folder


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_the_public_split_is_a_share_of_every_class_and_no_clients_data(dataset, partition):
    from clients.tasks.image import ImageTask

    cfg = compose([*TINY, f"partition={partition}"], task=dataset, algorithm="flite")
    public = ImageTask.public(cfg)
    server = np.concatenate([public.train_idx, public.test_idx])
    clients = np.concatenate([np.concatenate([t.train_idx, t.test_idx])
                              for t in (ImageTask(cfg, pid, 3) for pid in range(3))])
    assert len(np.intersect1d(server, clients)) == 0 and len(np.unique(clients)) == len(clients)
    counts = np.bincount(public.labels[server], minlength=10)
    per_class, pool = PUBLIC[dataset]
    assert counts.tolist() == [per_class] * 10  # 20% of each class (CIFAR-10: 1,000 test images per class)
    assert len(clients) == pool  # CIFAR-10: every other image; Fashion-MNIST: 10,000 of the other 56,000


def test_without_a_public_split_the_clients_data_is_what_it_was():
    from clients.partition import partition_for, train_test_split
    from clients.tasks.image import ImageTask
    from clients.tasks.vision import load_arrays

    cfg = compose(["model=tiny-cnn", "num_clients=3"], task="fmnist", algorithm="flite")
    labels = load_arrays("fmnist")[1]
    pool = np.sort(np.random.default_rng(int(cfg.seed)).choice(len(labels), 10_000, replace=False))
    mine = pool[partition_for(cfg, labels[pool], num_partitions=3, partition_id=1)]
    train, test = train_test_split(mine, 0.2, seed=int(cfg.seed) + 1)
    task = ImageTask(cfg, 1, 3)
    assert np.array_equal(task.train_idx, train) and np.array_equal(task.test_idx, test)


def test_theta_pre_is_built_once_reloaded_exactly_and_its_head_kept(dataset, cache):
    from clients.models.heads import orthogonal_head_
    from clients.models import build_model
    from clients.pretrain import base_checkpoint, ensure_base, read_report
    from fedapps.baselines import prepare as lora_prepare
    from fedapps.flite import prepare as flite_prepare

    cfg = compose(TINY, task=dataset, algorithm="flite")
    path = ensure_base(cfg)
    assert path.parent.parent == cache and base_checkpoint(cfg) == path
    stamp = path.stat().st_mtime_ns
    assert ensure_base(cfg) == path and path.stat().st_mtime_ns == stamp  # reused, not retrained
    report = read_report(cfg)
    assert report["public_images"] == PUBLIC[dataset][0] * 10 and report["settings"]["base"]["steps"] == 12
    assert report["cpu"]

    from safetensors.torch import load_file

    saved = load_file(str(path))
    model, _ = build_model(cfg)
    assert model.head_loaded and all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    drawn = torch.nn.Linear(32, 10)
    orthogonal_head_(drawn, seed=0)  # base.seed = 0: the head θ_pre was trained under
    assert torch.equal(saved["head.weight"], drawn.weight)
    assert not any(p.requires_grad for p in model.parameters())

    x = torch.randn(3, 3, 16, 16)
    flite, _, extra = flite_prepare(cfg)  # run seed 42: a re-draw would give another head
    assert torch.equal(flite.head.weight, saved["head.weight"]) and not flite.head.weight.requires_grad
    torch.testing.assert_close(flite(x), model(x))  # z = 0: θ_pre's outputs exactly
    lora, _, _ = lora_prepare(compose([*TINY, "model.lora_targets=['0','4']"], task=dataset,
                                      algorithm="fedavg-lora"))
    torch.testing.assert_close(lora(x), model(x))
    full, _, names = lora_prepare(compose(TINY, task=dataset, algorithm="fedavg-full"))
    torch.testing.assert_close(full(x), model(x))
    assert "head.weight" in names["names"]  # full FedAvg trains every weight, from θ_pre

    # another θ_pre (other settings) is another file, and FLITE's fingerprint tells them apart
    other = compose([*TINY, "base.steps=13"], task=dataset, algorithm="flite")
    assert ensure_base(other) != path
    assert flite_prepare(other)[2]["fingerprint"] != extra["fingerprint"]


def test_a_client_without_theta_pre_is_told_how_to_get_it(dataset, cache):
    from clients.assets import AssetMissing
    from clients.models import build_model

    with pytest.raises(AssetMissing, match="postcard pretrain"):
        build_model(compose([*TINY, "base.seed=7"], task=dataset, algorithm="flite"))


def test_postcard_pretrain_builds_then_reuses_and_refuses_bad_input(dataset, cache, capsys):
    from postcard.pretrain import main

    args = [f"task={dataset}", "model=tiny-cnn", "base.steps=5", "task.image_size=16"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "θ_pre:" in first and f"{PUBLIC[dataset][0] * 10} public images" in first
    assert main(args) == 0 and capsys.readouterr().out == first  # the same file and report, not retrained
    assert main(["task=cifar10", "base.stepz=5"]) == 2
    assert "did you mean 'base.steps'" in capsys.readouterr().err
    assert main(["task=shakespeare"]) == 2
    assert "image task" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, reason", [
    (["base=public"], "image task"),
    (["base=public", "task=cifar10", "task.public_fraction=0"], "needs a public split"),
    (["task=cifar10", "task.public_fraction=1.5"], r"in \[0, 1\)"),
    (["base=public", "task=cifar10", "base.steps=0"], "base.steps"),
])
def test_bad_base_settings_are_refused_at_compose_time(overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        compose(overrides, algorithm="fedavg-full")


def test_vision_model_path_loads_any_backbone_and_its_head(tmp_path):
    from clients.models import build_model
    from clients.models.mobilenet import MobileNetV2
    from clients.models.weights import CheckpointError

    source = MobileNetV2(num_classes=10)
    torch.save(source.state_dict(), tmp_path / "mnv2.pt")
    model, _ = build_model(compose([f"model.path={tmp_path / 'mnv2.pt'}"], task="cifar10", algorithm="fedavg-full"))
    assert model.head_loaded and torch.equal(model.head.weight, source.head.weight)
    assert torch.equal(model.features[5].conv[1][0].weight, source.features[5].conv[1][0].weight)
    torch.save({k: v for k, v in source.state_dict().items() if not k.startswith("classifier")}, tmp_path / "b.pt")
    body_only, _ = build_model(compose([f"model.path={tmp_path / 'b.pt'}"], task="cifar10", algorithm="flite"))
    assert not body_only.head_loaded  # no head in the file: FLITE draws its orthogonal one
    with pytest.raises(CheckpointError, match="is not a tiny CNN in this layout"):
        build_model(compose([f"model.path={tmp_path / 'b.pt'}", "model=tiny-cnn"], task="cifar10",
                            algorithm="flite"))


def test_resnet18_gn_has_a_cifar_stem_and_starts_from_a_random_init_for_base_public():
    from clients.models.resnet import ResNet18GN

    cifar, imagenet = ResNet18GN(stem="cifar"), ResNet18GN()
    x = torch.randn(2, 3, 32, 32)
    assert cifar.embed(x).shape == imagenet.embed(x).shape == (2, 512)
    assert cifar.conv1.kernel_size == (3, 3) and isinstance(cifar.maxpool, torch.nn.Identity)
    # the first block sees 32x32 maps with the CIFAR stem, 8x8 with the ImageNet one
    seen = {}
    for name, net in (("cifar", cifar), ("imagenet", imagenet)):
        net.layer1.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.shape[-1]))
        net(x)
    assert seen == {"cifar": 32, "imagenet": 8}
    cfg = compose(["model=resnet18-gn", "model.pretrained=false", "model.stem=cifar", "base=public"],
                  task="cifar10", algorithm="flite")
    assert cfg.base.name == "public" and cfg.task.public_fraction == pytest.approx(0.2)
    with pytest.raises(ValueError, match="stem"):
        ResNet18GN(stem="tiny")


def test_flite_split_by_sensitivity_uses_theta_pres_gradient_norms_measured_once(dataset, cache):
    """split=sensitivity: θ_pre's per-layer gradient norms on the public split (measured once, cached
    beside θ_pre) share FLITE's latents; the layout, so the fingerprint, follows them."""
    from clients.flite import FliteConfig
    from clients.flite.model import flite_layers, split_budget, split_weights
    from clients.models import build_model
    from clients.pretrain import base_folder_name, base_sensitivity
    from fedapps.flite import prepare as flite_prepare

    cfg = compose([*TINY, "algorithm.flite.split=sensitivity"], task=dataset, algorithm="flite")
    sensitivity = base_sensitivity(cfg)
    stored = cache / (base_folder_name(cfg) + "-sensitivity") / "sensitivity.json"
    stamp = stored.stat().st_mtime_ns
    assert base_sensitivity(cfg) == sensitivity and stored.stat().st_mtime_ns == stamp  # measured once
    model, _ = build_model(cfg)
    weights = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
               and not n.startswith("head")]
    assert sorted(sensitivity) == sorted(weights) and all(v > 0 for v in sensitivity.values())
    assert len(set(sensitivity.values())) == len(weights)  # measured, not a constant

    flite, _, extra = flite_prepare(cfg)
    layers = [layer.flite_spec for layer in flite_layers(flite) if layer.flite_spec.kind != "norm"]
    norm_latents = sum(layer.flite_spec.latents for layer in flite_layers(flite) if layer.flite_spec.kind == "norm")
    numels = [s.matrix_shape[0] * s.matrix_shape[1] for s in layers]
    expected = split_budget(1280 - norm_latents, [sensitivity[s.name] for s in layers], numels)
    assert [s.latents for s in layers] == expected
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(flite(x), model(x))  # z = 0: θ_pre
    sqrt = flite_prepare(compose(TINY, task=dataset, algorithm="flite"))[2]
    assert sqrt["fingerprint"] != extra["fingerprint"]

    with pytest.raises(ValueError, match="needs a sensitivity for every weight layer; none for"):
        split_weights("sensitivity", [4, 9], ["a", "b"], {"a": 1.0})
    with pytest.raises(ValueError, match="FliteConfig.sensitivity must map"):
        FliteConfig(split="sensitivity", sensitivity={"a": -1.0})
    with pytest.raises(ConfigError, match="split=sensitivity .* needs base=public"):
        compose(["model=tiny-cnn", "algorithm.flite.split=sensitivity"], task="cifar10", algorithm="flite")
