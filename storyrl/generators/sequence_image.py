"""The image sequence as one image, as the d_HM authors built it for the
``visual`` setting.

Measured on their files (``shared/data/dhm/vist/49620.png``: 1300x260;
``vwp/seq_tt0104348_0007_6_2.png``: 2820x244): every image gets a 2-pixel
white border and the bordered images are put side by side, top-aligned,
without gaps. VIST images were first resized to 256x256; VWP frames kept
their 560x240 size. ``size`` chooses the resize (None keeps each image's).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BORDER", "VIST_SIZE", "sequence_image"]

BORDER = 2
VIST_SIZE = (256, 256)


def sequence_image(images: Sequence, size: tuple[int, int] | None = None, border: int = BORDER):
    """One RGB PIL image of ``images`` (PIL images or paths) side by side,
    each resized to ``size`` (width, height) when given and framed by a
    white ``border``; images of different heights are top-aligned on white."""
    from PIL import Image, ImageOps

    from storyrl.images import Region, load_region

    if not images:
        raise ValueError("an image sequence needs at least one image")
    framed = []
    for image in images:
        img = load_region(Region(image))  # RGB; an unreadable file is an ImageError naming it
        if size is not None and img.size != tuple(size):
            img = img.resize(tuple(size), Image.Resampling.BICUBIC)
        framed.append(ImageOps.expand(img, border=border, fill="white"))
    out = Image.new("RGB", (sum(f.width for f in framed), max(f.height for f in framed)), "white")
    x = 0
    for f in framed:
        out.paste(f, (x, 0))
        x += f.width
    return out
