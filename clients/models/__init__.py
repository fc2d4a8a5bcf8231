"""Backbones: ``build_model(cfg) -> (model, tokenizer or None)``, frozen, on CPU."""

from __future__ import annotations


def build_model(cfg):
    kind = cfg.model.kind
    if kind == "causal_lm":
        from clients.models.llm import load_causal_lm

        return load_causal_lm(cfg.model, seed=int(cfg.seed))
    if kind == "vision":
        import torch

        classes = int(cfg.task.num_classes)  # the task says how many; the model needs no dataset
        state = torch.random.get_rng_state()
        torch.manual_seed(int(cfg.seed))  # the same new head on every client
        try:
            if cfg.model.arch == "mobilenet_v2":
                from clients.models.mobilenet import mobilenet_v2

                model = mobilenet_v2(num_classes=classes, pretrained=bool(cfg.model.pretrained))
            elif cfg.model.arch == "resnet18_gn":
                from clients.models.resnet import resnet18_gn

                model = resnet18_gn(cfg.model.path, num_classes=classes, groups=int(cfg.model.get("groups", 32)))
            elif cfg.model.arch == "tiny_cnn":
                from clients.models.cnn import TinyCNN

                model = TinyCNN(in_channels=3, num_classes=classes, width=int(cfg.model.get("width", 16)))
            else:
                raise ValueError(f"unknown vision arch '{cfg.model.arch}'")
        finally:
            torch.random.set_rng_state(state)
        model.requires_grad_(False)
        model.eval()
        return model, None
    raise ValueError(f"unknown model kind '{kind}' (model '{cfg.model.name}')")
