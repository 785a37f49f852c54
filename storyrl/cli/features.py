"""``storyrl features``: TAPM's visual features, computed once to disk."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _DIR, _FILE, _fail, _json
from storyrl.models.clip import IMAGE_PIPELINES
from storyrl.rewards.clip_base import ClipConfig


@click.command()
@click.option("--data", "data_paths", required=True, multiple=True, type=_FILE,
              help="Stories: JSONL records with images/image_ids, or a VIST story-in-sequence file (repeatable).")
@click.option("--image-root", type=_DIR, help="Directory that image ids (and relative image paths) resolve against.")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Feature directory to write (resumes: images already there are skipped).")
@click.option("--backbone", default="resnet101", show_default=True, help="timm model for the image features.")
@click.option("--vit", default=None, help="A second timm model whose features are concatenated (+ViT), "
              "e.g. vit_base_patch16_224.augreg_in21k.")
@click.option("--region-table", type=_FILE, help="Region table CSV (storyrl regions): adds box features.")
@click.option("--max-boxes", default=20, show_default=True, type=click.IntRange(min=1), help="Boxes per image.")
@click.option("--no-pretrained", is_flag=True, help="Random backbone weights (tests and smoke runs).")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--image-pipeline", type=click.Choice(IMAGE_PIPELINES), default=ClipConfig.image_pipeline,
              show_default=True, help="How pixels are made: fast (decoding in worker processes, resizing and "
              "normalising as tensors) or exact (PIL and the backbones' timm transforms). A store keeps one.")
@click.option("--device", default=None, help="torch device (default: CUDA when available).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def features(data_paths, image_root, out, backbone, vit, region_table, max_boxes, no_pretrained, batch_size,
             image_pipeline, device, quiet) -> None:
    """Compute TAPM's visual features (timm ResNet, +ViT, region boxes) of
    every image of the stories, once, into OUT (index.json + shards), which
    `storyrl train tapm` and TAPM generation read."""
    from storyrl.console import progress as progress_bar

    from storyrl.datasets import load_records
    from storyrl.generators.tapm.features import FeatureExtractor, image_keys, write_features
    from storyrl.images import RegionTable, resolve_images

    items = []
    for path in data_paths:
        for record in load_records(path):
            try:
                sources = resolve_images(record.images, record.image_ids, image_root)
                keys = image_keys(record)
            except ValueError as exc:
                _fail(f"{path}: record {record.story_id!r}: {exc}")
            items.extend(zip(keys, sources))
    if not items:
        _fail("no images in the given stories")
    regions = RegionTable(region_table, top_b=max_boxes) if region_table else None
    extractor = FeatureExtractor(backbone, vit=vit, regions=regions, max_boxes=max_boxes,
                                 pretrained=not no_pretrained, device=device, image_pipeline=image_pipeline)
    with progress_bar(total=len(dict(items)), desc="features", disable=quiet, unit="img") as bar:
        counts = write_features(out, items, extractor, batch_size=batch_size, progress=bar.update)
    click.echo(_json({"out": str(out), **counts}))
