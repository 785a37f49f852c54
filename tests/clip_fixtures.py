"""A tiny random-weight CLIP saved as an open_clip ``local-dir:`` model, and
tiny test images: the real loading path, without a hub download."""

from __future__ import annotations

import json
from pathlib import Path

TINY_CLIP_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def make_tiny_clip(directory: Path, seed: int = 0) -> str:
    """Write ``open_clip_config.json`` and random weights; return the model name."""
    import storyrl  # noqa: F401  (torchvision fallback before open_clip)
    import open_clip
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "open_clip_pytorch_model.bin").exists():
        torch.manual_seed(seed)
        model = open_clip.CLIP(**TINY_CLIP_CFG)
        (directory / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CLIP_CFG}))
        torch.save(model.state_dict(), directory / "open_clip_pytorch_model.bin")
    return f"local-dir:{directory}"


def make_images(directory: Path, n: int = 3, size: tuple[int, int] = (48, 40)) -> list[Path]:
    """``n`` distinct small RGB images (colour gradients) as PNG files."""
    import numpy as np
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    rng = np.random.default_rng(n)
    for k in range(n):
        w, h = size
        x = np.linspace(0, 1, w)[None, :, None]
        y = np.linspace(0, 1, h)[:, None, None]
        base = rng.uniform(0, 255, size=3)
        pixels = (base * (0.4 + 0.6 * x) * (0.5 + 0.5 * y) + 40 * k) % 256
        path = directory / f"img{k}.png"
        Image.fromarray(pixels.astype("uint8")).save(path)
        paths.append(path)
    return paths
