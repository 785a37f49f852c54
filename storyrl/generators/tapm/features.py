"""Visual features for TAPM: timm backbones run once per image, stored on disk.

A feature store is a directory::

    index.json              backbones, feature types, shards, image id -> (shard, row)
    shard-00000.safetensors one tensor per type: (n, tokens, dim)

Types: ``image`` (the ResNet features, with ``+ViT`` the ViT features
concatenated; one token) and, with a region table, ``boxes`` (the first
backbone's features of up to ``max_boxes`` regions, zero-padded). Writing is
resumable (images already in the index are skipped), each shard is complete
before the index names it (written aside and renamed), and ``index.json`` is
held under :class:`storyrl.output_files.LockedOutput` for the whole run, so a
second writer fails at once.

Pixels come from either image pipeline (issue 32): ``exact`` (PIL and each
backbone's timm transform) or ``fast`` (:mod:`storyrl.images.tensor_preprocess`:
decoding in worker processes, resizing and normalising as tensors). A fast
store's index names its pipeline (an exact one's keeps the description it
always had), so resuming with the other pipeline is refused, never mixed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FeatureExtractor", "FeatureStore", "image_keys", "pad_story_features", "write_features"]

INDEX = "index.json"

log = logging.getLogger(__name__)


def image_keys(record) -> list[str]:
    """The store keys of a record's images: its ``image_ids``, else the file
    stems of its ``images``."""
    if record.image_ids:
        return [str(i) for i in record.image_ids]
    if record.images:
        return [Path(str(p)).stem for p in record.images]
    raise ValueError(f"record {record.story_id!r}: no images or image_ids")


def pad_story_features(per_story: Sequence[dict[str, Any]]):
    """Batch the features of several stories: ``{type: (B, G, L, D)}`` zero
    tensors filled per story (G = the longest story's image count) and the
    (B, G) mask of real images. Each story's ``{type: (images, L, D)}``."""
    import torch

    B, G = len(per_story), max(next(iter(f.values())).shape[0] for f in per_story)
    mask = torch.zeros(B, G, dtype=torch.bool)
    features = {}
    for t in per_story[0]:
        _, L, D = per_story[0][t].shape
        features[t] = torch.zeros(B, G, L, D)
        for b, f in enumerate(per_story):
            features[t][b, : f[t].shape[0]] = f[t]
            mask[b, : f[t].shape[0]] = True
    return features, mask


class FeatureExtractor:
    """Pooled timm features (``num_classes=0``) of whole images and regions.

    ``backbone`` (ResNet by default) gives the ``image`` features; ``vit``
    adds a second backbone whose features are concatenated (``+ViT``);
    ``regions`` (a :class:`storyrl.images.RegionTable`) adds ``boxes``.
    ``pretrained=False`` builds random weights (tests, smoke runs).
    ``image_pipeline``: "exact" (PIL) or "fast" (tensors; see the module docs)."""

    def __init__(self, backbone: str = "resnet101", vit: str | None = None, regions=None, max_boxes: int = 20,
                 pretrained: bool = True, device=None, image_pipeline: str = "exact") -> None:
        import timm
        import torch

        from storyrl.models.clip import IMAGE_PIPELINES
        from storyrl.models.hub import require_hub_model, timm_hub_id
        from storyrl.models.runtime import resolve_device

        if image_pipeline not in IMAGE_PIPELINES:
            raise ValueError(f"image_pipeline must be one of {', '.join(IMAGE_PIPELINES)}, got {image_pipeline!r}")
        self.image_pipeline = image_pipeline
        self._fast_specs: dict[int, Any] = {}
        self.device = resolve_device(device)
        self.names = [backbone] + ([vit] if vit else [])
        self.models, self.transforms = [], []
        for name in self.names:
            hub_id = timm_hub_id(name) if pretrained else None
            if hub_id:
                require_hub_model(hub_id, what=f"timm backbone {name!r} (weights)",
                                  hint="pass --no-pretrained (random weights)")
            try:
                model = timm.create_model(name, pretrained=pretrained, num_classes=0)
            except RuntimeError as exc:  # unknown model name
                raise ValueError(f"timm backbone {name!r}: {exc}") from None
            model.eval().to(self.device)
            config = timm.data.resolve_data_config({}, model=model)
            self.models.append(model)
            self.transforms.append(timm.data.create_transform(**config))
        self.regions = regions
        self.max_boxes = max_boxes
        self.pretrained = pretrained
        self._torch = torch

    def describe(self) -> dict[str, Any]:
        """What the features were made with (stored in the index and the model).
        The pipeline is named unless exact, so stores written before it existed still match."""
        out = {"backbone": self.names[0], "vit": self.names[1] if len(self.names) > 1 else None,
               "pretrained": self.pretrained, "max_boxes": self.max_boxes if self.regions is not None else None}
        if self.image_pipeline != "exact":
            out["image_pipeline"] = self.image_pipeline
        return out

    def types(self) -> dict[str, dict[str, int]]:
        dims = [m.num_features for m in self.models]
        out = {"image": {"dim": sum(dims), "tokens": 1}}
        if self.regions is not None:
            out["boxes"] = {"dim": dims[0], "tokens": self.max_boxes}
        return out

    def _embed(self, model_index: int, images: list) -> Any:
        torch = self._torch
        batch = torch.stack([self.transforms[model_index](im) for im in images]).to(self.device)
        with torch.no_grad():
            return self.models[model_index](batch).float().cpu()

    def _fast_spec(self, model_index: int):
        """The fast pipeline's reading of a backbone's transform (None: it
        cannot reproduce it, and that backbone uses the exact one, said once)."""
        if model_index not in self._fast_specs:
            from storyrl.images.tensor_preprocess import reproducible_spec

            self._fast_specs[model_index] = reproducible_spec(
                self.transforms[model_index], f"timm backbone {self.names[model_index]!r}", log)
        return self._fast_specs[model_index]

    def _fast(self, model_index: int) -> bool:
        return self.image_pipeline == "fast" and self._fast_spec(model_index) is not None

    def _fast_features(self, model_index: int, regions: list, batch_size: int) -> Any:
        """``[len(regions), dim]`` features of ``regions`` (in their order) by
        the fast pipeline; raises ImageError for an unreadable image."""
        from storyrl.images.tensor_preprocess import region_batches

        torch = self._torch
        out = torch.zeros(len(regions), self.models[model_index].num_features)
        if not regions:
            return out
        # region_batches gives regions grouped by image: put each batch's rows back in place.
        rows: dict[Any, list[int]] = {}
        for i, region in enumerate(regions):
            rows.setdefault(region.key, []).append(i)
        unique = [regions[i[0]] for i in rows.values()]
        batches = region_batches(unique, self._fast_spec(model_index), self.device, torch.float32,
                                 batch_size)  # the backbones run in fp32
        with contextlib.closing(batches), torch.no_grad():
            for chunk, pixels in batches:
                feats = self.models[model_index](pixels).float().cpu()
                for region, feat in zip(chunk, feats):
                    out[rows[region.key]] = feat
        return out

    def __call__(self, sources: Sequence[Any], keys: Sequence[str]) -> dict[str, Any]:
        """Features of images (paths or PIL images) as ``{type: (n, tokens, dim)}``."""
        from storyrl.images import Region, load_regions

        torch = self._torch
        batch_size = max(len(sources), 1)  # one forward per call, as the exact pipeline's
        whole = [Region(s) for s in sources]
        decoded = None  # the exact pipeline's images, decoded once for every backbone that needs them
        parts = []
        for i in range(len(self.models)):
            if self._fast(i):
                parts.append(self._fast_features(i, whole, batch_size))
            else:
                decoded = decoded if decoded is not None else load_regions(whole)
                parts.append(self._embed(i, decoded))
        out = {"image": torch.cat(parts, dim=1).unsqueeze(1)}
        if self.regions is not None:
            dim = self.models[0].num_features
            boxes = torch.zeros(len(sources), self.max_boxes, dim)
            per_image = [regs[: self.max_boxes] for regs in self.regions.regions(list(sources), list(keys))]
            if self._fast(0):  # every box of the call in one stream of batches
                flat = self._fast_features(0, [r for regs in per_image for r in regs], batch_size)
                start = 0
                for n, regs in enumerate(per_image):
                    boxes[n, : len(regs)] = flat[start : start + len(regs)]
                    start += len(regs)
            else:
                for n, regs in enumerate(per_image):
                    boxes[n, : len(regs)] = self._embed(0, load_regions(regs))
            out["boxes"] = boxes
        return out


class FeatureStore:
    """Read access to a feature directory (see the module docs)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        path = self.directory / INDEX
        try:
            self.index = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no feature index (make one with `storyrl features`)") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable feature index: {exc}") from None
        self._shards: dict[int, dict] = {}

    @property
    def types(self) -> dict[str, dict[str, int]]:
        return self.index["types"]

    @property
    def backbones(self) -> dict[str, Any]:
        return self.index["backbones"]

    def __contains__(self, key: str) -> bool:
        return key in self.index["images"]

    def _shard(self, n: int) -> dict:
        if n not in self._shards:
            from safetensors.torch import load_file

            self._shards[n] = load_file(str(self.directory / self.index["shards"][n]))
        return self._shards[n]

    def get(self, keys: Sequence[str], where: str = "") -> dict[str, Any]:
        """``{type: (len(keys), tokens, dim)}`` for the given image keys."""
        import torch

        missing = [k for k in keys if k not in self.index["images"]]
        if missing:
            raise KeyError(f"{self.directory}: no features for image id {missing[0]!r}{where}")
        rows = [self.index["images"][k] for k in keys]
        return {t: torch.stack([self._shard(s)[t][r] for s, r in rows]) for t in self.types}


def write_features(directory: str | os.PathLike, items: Sequence[tuple[str, Any]], extractor: FeatureExtractor,
                   batch_size: int = 32, progress: Callable[[int], Any] | None = None) -> dict[str, int]:
    """Compute features of ``items`` (``(key, image source)``; duplicates
    once) into ``directory``, skipping keys already there. Returns counts."""
    from safetensors.torch import save_file

    from storyrl.output_files import LockedOutput

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    unique = dict(items)
    with LockedOutput(directory / INDEX, existing="keep") as out:
        text = "".join(out.read())
        if text.strip():
            try:
                index = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{directory / INDEX}: unreadable feature index: {exc}") from None
            if index.get("backbones") != extractor.describe() or index.get("types") != extractor.types():
                raise ValueError(f"{directory}: holds features made with {index.get('backbones')}, not "
                                 f"{extractor.describe()}; use another directory")
        else:
            index = {"format": 1, "backbones": extractor.describe(), "types": extractor.types(),
                     "shards": [], "images": {}}
        todo = [(k, s) for k, s in unique.items() if k not in index["images"]]
        if not text.strip():
            out.replace(json.dumps(index) + "\n")  # a valid (empty) store even if nothing follows
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            tensors = extractor([s for _, s in chunk], [k for k, _ in chunk])
            name = f"shard-{len(index['shards']):05d}.safetensors"
            tmp = directory / f".{name}.tmp"
            save_file({t: v.contiguous() for t, v in tensors.items()}, str(tmp))
            os.replace(tmp, directory / name)  # complete before the index names it
            shard = len(index["shards"])
            index["shards"].append(name)
            for row, (key, _) in enumerate(chunk):
                index["images"][key] = [shard, row]
            out.replace(json.dumps(index) + "\n")
            if progress is not None:
                progress(len(chunk))
    return {"images": len(unique), "computed": len(todo), "skipped": len(unique) - len(todo)}
