"""Writing region tables: torchvision's Faster R-CNN over image files.

:func:`detect_regions` writes the CSV that :class:`~storyrl.images.RegionTable`
reads, appending batch by batch under a :class:`~storyrl.output_files.LockedOutput`
so that an interrupted run resumes. torch/torchvision are imported only inside
the functions that need them, so this module stays cheap to import.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from storyrl.images.loading import _open_rgb

DETECTION_CSV_COLUMNS = ("image_name", "image_id", "bbox", "object", "score")
COCO_CHECKPOINT = "fasterrcnn_resnet50_fpn_coco-258fb6c6.pth"
COCO_CHECKPOINT_URL = "https://download.pytorch.org/models/" + COCO_CHECKPOINT


def _default_weights() -> Path:
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints" / COCO_CHECKPOINT


def _format_bbox(box: Iterable[float]) -> str:
    # Same text as str() of a list of 2-decimal floats: "[518.02, 30.21, 655.02, 189.49]".
    return str([round(float(v), 2) for v in box])


def _row_image_id(line: str) -> str | None:
    fields = next(csv.reader([line]), [])
    return fields[1] if len(fields) >= 2 else None


def _done_images(out) -> set[str]:
    """Image ids already in a region table (a :class:`LockedOutput`). The
    whole file is validated first (header, cell counts; errors name the
    line); a file cut mid-row by a kill is then repaired atomically, dropping
    the last image's rows, which may be incomplete, so it is detected again."""
    from storyrl.data import StoryDataError

    complete, partial = out.read()
    lines = complete.splitlines(keepends=True)
    if not lines:
        return set()
    header = next(csv.reader([lines[0]]), [])
    if [c.strip() for c in header] != list(DETECTION_CSV_COLUMNS):
        raise StoryDataError(
            out.path, f"header {header!r} is not {list(DETECTION_CSV_COLUMNS)!r}; refusing to append", "at line 1"
        )
    ids = []
    for lineno, line in enumerate(lines[1:], 2):
        fields = next(csv.reader([line]), [])
        if len(fields) != len(DETECTION_CSV_COLUMNS):
            raise StoryDataError(
                out.path, f"expected {len(DETECTION_CSV_COLUMNS)} cells, got {len(fields)}", f"at line {lineno}"
            )
        ids.append(fields[1])
    if partial:
        drop = set(ids[-1:]) | {_row_image_id(partial)} - {None}
        kept = [line for line, image_id in zip(lines[1:], ids) if image_id not in drop]
        out.replace(lines[0] + "".join(kept))
        ids = [i for i in ids if i not in drop]
    return set(ids)


def _read_tensor(path: str):
    import numpy as np
    import torch

    image = _open_rgb(path)
    array = np.asarray(image, dtype=np.uint8).copy()
    return torch.from_numpy(array).permute(2, 0, 1).float().div_(255.0)


def detect_regions(
    image_paths: Iterable[str | os.PathLike],
    out_csv: str | os.PathLike,
    weights: str | os.PathLike | None = None,
    top_b: int = 10,
    score_threshold: float = 0.0,
    device: str | None = None,
    batch_size: int = 4,
    progress: bool = True,
    **model_kwargs: Any,
) -> Path:
    """Detect regions with torchvision's Faster R-CNN (ResNet-50 FPN) and write
    the authors' CSV (``image_name,image_id,bbox,object,score``), ``top_b`` boxes
    per image by score.

    ``weights`` is a local state-dict file; by default torchvision's cached COCO
    checkpoint. ``object`` is the COCO category name for 91-class (COCO) models,
    else the label index. Rows are appended batch by batch; images whose id
    (file stem) is already in ``out_csv`` are skipped, so an interrupted run
    resumes (an image with no detections is redone). ``model_kwargs`` go to
    ``fasterrcnn_resnet50_fpn`` (e.g. ``min_size``/``max_size`` for speed).

    Note the authors used a Visual Genome ResNet-101 detector; these are COCO
    boxes, so scores will differ from theirs.
    """
    if isinstance(top_b, bool) or not isinstance(top_b, int) or top_b < 1:
        raise ValueError(f"top_b must be a positive integer, got {top_b!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    paths = [str(p) for p in image_paths]
    ids: dict[str, str] = {}
    for p in paths:
        stem = Path(p).stem
        if stem in ids and ids[stem] != p:
            raise ValueError(f"images {ids[stem]} and {p} share the image id {stem!r} (file stem)")
        ids[stem] = p
    paths = list(ids.values())  # duplicates of the same path are detected once

    weights_path = Path(weights) if weights is not None else _default_weights()
    if not weights_path.is_file():
        how = (
            f"download {COCO_CHECKPOINT_URL} on a machine with internet access and copy it to "
            f"{_default_weights()}, or pass its path as weights (--weights)"
        )
        looked = "the weights file" if weights is not None else "torchvision's cached COCO checkpoint"
        raise FileNotFoundError(f"Faster R-CNN weights not found: looked for {looked} {weights_path}; {how}")

    from storyrl.output_files import LockedOutput

    out_path = Path(out_csv)
    with LockedOutput(out_path, "keep") as out:  # locked until the table is written
        if not out.read()[0]:
            out.replace(",".join(DETECTION_CSV_COLUMNS) + "\n")
        done = _done_images(out)
        todo = [p for p in paths if Path(p).stem not in done]
        if todo:  # all done: do not pay for loading the model
            _detect_into(out, todo, weights_path, top_b, score_threshold, device, batch_size, progress, model_kwargs)
    return out_path


def _detect_into(out, todo, weights_path, top_b, score_threshold, device, batch_size, progress, model_kwargs) -> None:
    """Run the detector over ``todo`` and append its rows to ``out``."""
    import torch
    import torchvision  # noqa: F401  (storyrl's import hook makes this work without compiled ops)
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights, fasterrcnn_resnet50_fpn

    from storyrl.console import progress as progress_bar

    state = torch.load(weights_path, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        for wrapper in ("model", "state_dict"):
            if isinstance(state.get(wrapper), dict):
                state = state[wrapper]
                break
    try:
        num_classes = int(state["roi_heads.box_predictor.cls_score.weight"].shape[0])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{weights_path}: not a fasterrcnn_resnet50_fpn state dict") from exc
    kwargs = {"num_classes": num_classes, "box_score_thresh": score_threshold, **model_kwargs}
    kwargs.setdefault("box_detections_per_img", max(100, top_b))
    model = fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None, **kwargs)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"{weights_path}: does not fit fasterrcnn_resnet50_fpn: {exc}") from exc
    categories = FasterRCNN_ResNet50_FPN_Weights.COCO_V1.meta["categories"]
    names = categories if num_classes == len(categories) else None
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model.eval().to(device)
    if progress and str(device).startswith("cpu"):
        # Measured: Faster R-CNN R50-FPN takes 30-50 s per VIST-sized image on a CPU core or
        # two; tqdm's own ETA appears only after the first batch, minutes in.
        low, high = (len(todo) * s / 60 for s in (30, 50))
        print(f"detecting regions in {len(todo)} image{'s' * (len(todo) != 1)} on CPU: about 30-50 s per image, "
              f"ETA {low:.0f}-{high:.0f} min (a GPU takes well under a second per image; --device cuda)",
              file=sys.stderr, flush=True)

    with progress_bar(total=len(todo), file=sys.stderr, disable=not progress, unit="img",
                      desc="detecting regions") as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            tensors = [_read_tensor(p).to(device) for p in batch]
            with torch.inference_mode():
                outputs = model(tensors)
            rows = []
            for path, detection in zip(batch, outputs):
                scores = detection["scores"].float().cpu()
                order = torch.argsort(scores, descending=True, stable=True)[:top_b]
                boxes, labels = detection["boxes"].float().cpu()[order], detection["labels"].cpu()[order]
                for box, label, score in zip(boxes.tolist(), labels.tolist(), scores[order].tolist()):
                    obj = names[label] if names is not None and 0 <= label < len(names) else str(label)
                    rows.append((Path(path).name, Path(path).stem, _format_bbox(box), obj, round(score, 6)))
            buffer = io.StringIO()
            csv.writer(buffer, lineterminator="\n").writerows(rows)
            out.write(buffer.getvalue())  # flushed: a kill loses at most the current batch
            bar.update(len(batch))
