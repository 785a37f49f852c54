"""Data-preparation commands: ``regions`` (object regions for GROOViST) and
``assets`` (downloads of the data files storyrl cannot ship)."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _DIR, _FILE, _fail


@click.command()
@click.argument("images", nargs=-1, type=_FILE)
@click.option("--image-dir", type=_DIR, help="Detect regions in every image of this directory.")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Region table CSV to write (resumes if it exists).")
@click.option("--weights", type=_FILE, help="Faster R-CNN weights (default: torchvision's cached COCO checkpoint).")
@click.option("--top-b", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--score-threshold", default=0.0, show_default=True, type=float)
@click.option("--device", default=None)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def regions(images, image_dir, out, weights, top_b, score_threshold, device, quiet) -> None:
    """Detect object regions with torchvision's Faster R-CNN and write a region
    table (the authors' CSV: image_name,image_id,bbox,object,score) usable with
    --region-table."""
    from storyrl.images import IMAGE_EXTENSIONS, detect_regions

    paths = list(images)
    if image_dir is not None:
        paths += sorted(p for p in image_dir.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
    if not paths:
        _fail("no images: pass image files or --image-dir")
    try:
        detect_regions(paths, out, weights=weights, top_b=top_b, score_threshold=score_threshold, device=device, progress=not quiet)
    except (FileNotFoundError, ValueError) as exc:  # ImageError is a ValueError
        _fail(str(exc))
    click.echo(f"wrote {out}")


@click.command()
@click.argument("names", nargs=-1)
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), help="Directory to put them in (default: storyrl's cache).")
@click.option("--force", is_flag=True, help="Download again even when present.")
def assets(names, dest, force) -> None:
    """Download the data files storyrl cannot ship (concreteness ratings,
    pronoun list) from their public sources, and say where they went."""
    from storyrl.assets import ASSETS, download_assets

    unknown = [n for n in names if n not in ASSETS]
    if unknown:
        _fail(f"unknown asset {unknown[0]!r}; available: {', '.join(ASSETS)}")
    try:
        paths = download_assets(list(names) or None, dest=dest, force=force)
    except RuntimeError as exc:
        _fail(str(exc))
    for path in paths:
        click.echo(str(path))
