"""Normalized sharpness of timm and torchvision vision models: ResNets, ConvNeXt, ViTs.

Every model is built from a small configuration with random weights
(``pretrained=False``; nothing is downloaded) and analyzed with the default
``ggn`` estimator on one batch of random images. The report's metadata says
what was analyzed: ``coverage`` (the analyzed fraction of all weight-matrix
entries) and ``excluded`` (biases, normalization scales, layer-scale vectors,
class tokens, each with its reason). A ViT's learned position table is analyzed
as the embedding of the positions; timm's packed ``qkv`` projection is split into
query, key and value.

Run: ``python examples/timm_models.py``
"""

from __future__ import annotations

import timm
import torch
import torchvision

import normflat


def models() -> dict[str, tuple[torch.nn.Module, int]]:
    """``{name: (model, image size)}``; three classes each."""
    torch.manual_seed(0)
    tv_vit = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2,
                                                  hidden_dim=16, mlp_dim=32, num_classes=3)
    torch.nn.init.normal_(tv_vit.heads.head.weight, std=0.1)  # torchvision zero-initializes the head
    return {
        "timm resnet (tiny)": (timm.create_model("resnet18", pretrained=False, num_classes=3, stem_width=8,
                                                 channels=(8, 16, 16, 32), layers=(1, 1, 1, 1)), 32),
        "timm convnext (tiny)": (timm.create_model("convnext_atto", pretrained=False, num_classes=3,
                                                   depths=(1, 1, 1, 1), dims=(8, 16, 16, 32)), 32),
        "timm vit (tiny)": (timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3,
                                              img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2), 16),
        "torchvision resnet18": (torchvision.models.resnet18(num_classes=3), 32),
        "torchvision vit (tiny)": (tv_vit, 16),
    }


def main() -> None:
    g = torch.Generator().manual_seed(1)
    for name, (model, size) in models().items():
        x = torch.randn(4, 3, size, size, generator=g)
        y = torch.arange(4) % 3
        report = normflat.analyze(model, [(x, y)], progress=False)
        meta = report.metadata
        print(f"{name}: {len(report.layers)} matrices, coverage {meta['coverage']:.3f}, "
              f"{len(meta['excluded'])} excluded, normalized sharpness {report.normalized_sharpness:.4g}")
        if "vit" in name:
            tokens = {k: v for k, v in meta["excluded"].items() if "token" in k}
            tables = [f"{layer.name} {layer.shape}" for layer in report.layers if layer.kind == "position_embedding"]
            attention = [layer.name for layer in report.layers if ".attn." in layer.name or "attention" in layer.name]
            print(f"  position table: {tables}; excluded tokens: {sorted(tokens)}")
            print(f"  attention matrices: {attention}")


if __name__ == "__main__":
    main()
