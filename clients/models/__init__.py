"""Backbones: ``build_model(cfg) -> (model, tokenizer or None)``, frozen, on CPU."""

from __future__ import annotations

ARCH_NAMES = {"mobilenet_v2": "MobileNetV2", "resnet18_gn": "ResNet-18 with GroupNorm", "tiny_cnn": "tiny CNN"}


def build_model(cfg):
    kind = cfg.model.kind
    if kind == "causal_lm":
        from clients.models.llm import load_causal_lm

        return load_causal_lm(cfg.model, seed=int(cfg.seed))
    if kind == "vision":
        checkpoint = cfg.model.get("path")
        if cfg.get("base") is not None and cfg.base.name == "public":  # θ_pre, head included
            from clients.models.base import base_checkpoint

            checkpoint = base_checkpoint(cfg)
        return vision_model(cfg, checkpoint), None
    raise ValueError(f"unknown model kind '{kind}' (model '{cfg.model.name}')")


def vision_model(cfg, checkpoint=None):
    """The vision backbone of ``cfg.model`` with a ``task.num_classes``-way head, frozen, in eval
    mode; its weights from ``checkpoint`` (a state-dict file: body exactly, the head when it fits;
    ``model.head_loaded`` says whether it did), else the model group's own (ImageNet for
    MobileNetV2, a random init for the tiny CNN or an unpretrained ResNet)."""
    import torch

    from clients.models.weights import load_weights

    classes = int(cfg.task.num_classes)  # the task says how many; the model needs no dataset
    arch = cfg.model.arch
    state = torch.random.get_rng_state()
    torch.manual_seed(int(cfg.seed))  # the same new head on every client
    try:
        if arch == "mobilenet_v2":
            from clients.models.mobilenet import mobilenet_v2

            model = mobilenet_v2(num_classes=classes, pretrained=bool(cfg.model.pretrained) and checkpoint is None)
        elif arch == "resnet18_gn":
            from clients.models.resnet import resnet18_gn

            model = resnet18_gn(None, num_classes=classes, groups=int(cfg.model.get("groups", 32)),
                                stem=str(cfg.model.get("stem", "imagenet")))
        elif arch == "tiny_cnn":
            from clients.models.cnn import TinyCNN

            model = TinyCNN(in_channels=3, num_classes=classes, width=int(cfg.model.get("width", 16)))
        else:
            raise ValueError(f"unknown vision arch '{arch}'")
    finally:
        torch.random.set_rng_state(state)
    if checkpoint is not None:
        load_weights(model, checkpoint, what=ARCH_NAMES.get(arch, str(arch)))
    else:
        model.head_loaded = False
    model.requires_grad_(False)
    model.eval()
    return model
