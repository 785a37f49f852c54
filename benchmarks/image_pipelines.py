"""The CLIP rewards' two image pipelines side by side (issue 32): ``exact``
(PIL decoding, cropping and the model's torchvision transform per region,
the authors' scores) and ``fast`` (decoding in worker processes, regions as
tensor slices, resizing and normalising on the model's device in batches).
Helpers of ``benchmarks/groovist.py`` and of the GPU suite's clip part.

* :func:`write_photos`: photo-like JPEGs of VIST's sizes (500x375 to
  1024x768, landscape and portrait) with a natural image's 1/f^1.2
  amplitude spectrum and mild noise, JPEG quality 90 (~4 bits a pixel):
  small noise images would misstate decoding, a large share of the work.
* :func:`compare`: on the same images and model, in one run, the
  preprocessing stage alone (decode + crop + resize + normalise, no model)
  and GROOViST / CLIPScore end to end on a first visit (embedding caches
  emptied), exact and fast alternately, best of ``rounds`` each; and the
  largest score difference between the pipelines.
* :func:`real_image_differences`: the score differences on the authors'
  real frames (VWP and VIST sequences) and stories, with a random-weight
  CLIP of the authors' ViT-B/32 architecture.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

VIST_SIZES = [(500, 375), (640, 480), (1024, 768), (800, 600), (375, 500), (768, 1024), (500, 333), (1024, 683)]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def write_photos(directory: Path, n: int, seed: int = 0, sizes: list[tuple[int, int]] | None = None) -> list[str]:
    """``n`` photo-like RGB JPEGs, (width, height) cycling through ``sizes`` (default VIST_SIZES)."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = sizes or VIST_SIZES
    paths = []
    for k in range(n):
        w, h = sizes[k % len(sizes)]
        fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
        # Natural images' amplitude spectrum falls as 1/f^a, a ~ 1-1.2 (here 1.2, with mild
        # sensor noise): ~4 bits a pixel at quality 90, the busy end of real photos.
        amplitude = 1.0 / np.maximum(np.hypot(fy, fx), 1.0 / max(w, h)) ** 1.2
        channels = []
        for _ in range(3):
            phase = rng.uniform(0, 2 * np.pi, amplitude.shape)
            channels.append(np.fft.irfft2(amplitude * np.exp(1j * phase), s=(h, w)))
        field = np.stack(channels, -1) @ rng.uniform(0.2, 1.0, (3, 3))  # correlated colours
        lo, hi = np.percentile(field, [1, 99])
        pixels = (field - lo) / (hi - lo) * 255 + rng.normal(0, 1, field.shape)
        path = directory / f"photo{k}.jpg"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(str(path))
    return paths


def detector_boxes(path: str, count: int, rng) -> list[list[float]]:
    """``count`` boxes shaped like an object detector's (8-70% of each side, float corners)."""
    from PIL import Image

    w, h = Image.open(path).size
    boxes = []
    for _ in range(count):
        bw, bh = rng.uniform(0.08, 0.7) * w, rng.uniform(0.08, 0.7) * h
        x1, y1 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
        boxes.append([x1, y1, x1 + bw, y1 + bh])
    return boxes


def write_region_table(path: Path, photos: list[str], per_image: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines = ["image_name,image_id,bbox"]
    for photo in photos:
        name = Path(photo).name
        for box in detector_boxes(photo, per_image, rng):
            lines.append(f'{name},{Path(photo).stem},"[{", ".join(repr(float(v)) for v in box)}]"')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _clear(embedder) -> None:
    embedder.texts.clear()
    embedder.regions.clear()


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def preprocessing_seconds(embedder, regions: list, pipeline: str) -> float:
    """Seconds to make every region's model input (decode, crop, resize,
    normalise; no model), ``embedder.batch_size`` regions a batch, as
    ``embed_regions`` makes them."""
    from storyrl.images import load_regions
    from storyrl.images.tensor_preprocess import region_batches

    _sync(embedder.device)
    start = time.perf_counter()
    if pipeline == "exact":
        for k in range(0, len(regions), embedder.batch_size):
            embedder.exact_pixels(load_regions(regions[k:k + embedder.batch_size]))
    else:
        for _ in region_batches(regions, embedder.fast_spec, embedder.device, embedder.dtype, embedder.batch_size):
            pass
    _sync(embedder.device)
    return time.perf_counter() - start


def _timed_score(reward, stories, context, device) -> tuple[float, np.ndarray]:
    _clear(reward.embedder)
    _sync(device)
    start = time.perf_counter()
    scores = reward.score(stories, **context)
    _sync(device)
    return time.perf_counter() - start, np.asarray(scores, dtype=np.float64)


def compare(model: str, photos: list[str], table: Path, stories: list[list[str]], per_image: int,
            device: str = "cpu", precision: str = "fp32", rounds: int = 2, pronouns: str | None = None) -> dict:
    """Exact vs fast on ``photos`` (see module docs). ``stories``: per
    sequence of 5 photos, the candidates' noun-phrase lists."""
    from storyrl.images import Region, sequence_regions
    from storyrl.rewards import create_reward

    common = {"clip_model": model, "clip_pretrained": None, "device": device, "precision": precision}
    groovist = {p: create_reward("groovist", **common, image_pipeline=p, regions="table", region_table=str(table),
                                 image_root=str(Path(photos[0]).parent), top_b=per_image, weighting="none",
                                 pronouns=pronouns) for p in ("exact", "fast")}
    clipscore = {p: create_reward("clipscore", **common, image_pipeline=p) for p in ("exact", "fast")}
    for reward in (*groovist.values(), *clipscore.values()):
        reward._pronoun_set = frozenset()  # the NPs are given: nothing to drop
        reward.text_units_given = True  # no spaCy pipeline needed
        reward.setup()
    embedder = groovist["exact"].embedder
    sequences = [[Path(p).stem for p in photos[k:k + 5]] for k in range(0, len(photos) - 4, 5)]
    texts, ids, nps, images = [], [], [], []
    for seq, candidates in zip(sequences, stories):
        for phrases in candidates:
            texts.append(" . ".join(phrases) + " .")
            ids.append(seq)
            nps.append(phrases)
            images.append([str(Path(photos[0]).parent / f"{i}.jpg") for i in seq])
    n_images = 5 * len(sequences)
    regions = []
    for seq, paths in zip(sequences, images[::len(stories[0])]):
        regions += sequence_regions(groovist["exact"].region_source, paths, seq)
    # Warm-up (model, worker processes, allocator) on a throwaway input.
    for p in ("exact", "fast"):
        groovist[p].score(texts[:1], image_ids=ids[:1], noun_phrases=nps[:1])
        clipscore[p].score(texts[:1], images=images[:1])
        preprocessing_seconds(embedder, regions[:per_image], p)
    best: dict = {}
    scores: dict = {}
    for _ in range(rounds):
        for p in ("exact", "fast"):
            figures = {
                "preprocessing": preprocessing_seconds(embedder, regions, p),
                "preprocessing_whole": preprocessing_seconds(embedder, [Region(i) for seq in images[::len(stories[0])]
                                                                        for i in seq], p),
            }
            figures["groovist"], scores[("groovist", p)] = _timed_score(
                groovist[p], texts, {"image_ids": ids, "noun_phrases": nps}, device)
            figures["clipscore"], scores[("clipscore", p)] = _timed_score(clipscore[p], texts, {"images": images},
                                                                          device)
            for key, seconds in figures.items():
                best[(key, p)] = min(best.get((key, p), math.inf), seconds)
    out = {"images": n_images, "regions": len(regions), "stories": len(texts), "rounds": rounds}
    for key in ("preprocessing", "groovist", "preprocessing_whole", "clipscore"):
        unit = n_images
        out[key] = {"exact_images_per_s": unit / best[(key, "exact")], "fast_images_per_s": unit / best[(key, "fast")],
                    "speedup": best[(key, "exact")] / best[(key, "fast")]}
    for name in ("groovist", "clipscore"):
        diff = np.abs(scores[(name, "fast")] - scores[(name, "exact")])
        out[name]["max_score_difference"] = float(np.nanmax(diff))
    return out


# -- the authors' real frames and stories ----------------------------------------------


def split_frames(png: Path, count: int, directory: Path) -> list[str]:
    """The ``count`` images of a horizontally concatenated sequence, as PNG files."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    width = image.size[0] // count
    paths = []
    for k in range(count):
        path = directory / f"{png.stem}_{k}.png"
        image.crop((k * width, 0, (k + 1) * width, image.size[1])).save(path)
        paths.append(str(path))
    return paths


def concrete_words(story: str, ratings: dict[str, float], threshold: float = 4.0) -> list[str]:
    """A stand-in for spaCy's noun chunks (no pipeline offline): the story's
    distinct words rated at least ``threshold`` concrete."""
    words = [w.strip(".,!?;:'\"()[]").lower() for w in story.split()]
    return list(dict.fromkeys(w for w in words if ratings.get(w, 0.0) >= threshold))


def real_image_differences(root: Path, model: str, n_stories: int, device: str = "cpu") -> dict:
    """GROOViST and CLIPScore, exact vs fast, on the VWP and VIST sequences'
    frames with the authors' stories (the first ``n_stories`` of each file)."""
    from storyrl.rewards import create_reward
    from storyrl.word_weights import Concreteness

    vwp, vist, gv = SHARED / "dhm" / "vwp", SHARED / "dhm" / "vist", SHARED / "groovist"
    frames_dir = root / "frames"
    frames_dir.mkdir()
    sets = {"vwp": split_frames(vwp / "seq_tt0104348_0007_6_2.png", 5, frames_dir),
            "vist": split_frames(vist / "49620.png", 5, frames_dir)}
    ratings = Concreteness.from_path(str(gv / "concreteness_ratings.csv"))
    table = ratings.ratings
    rows = []  # (dataset, system, story, noun phrases)
    for dataset, folder in (("vwp", vwp), ("vist", vist)):
        for system in ("gt_test", "llava_vc_p3"):
            stories = list(json.loads((folder / f"{system}.json").read_text(encoding="utf-8")).values())[:n_stories]
            rows += [(dataset, system, s, concrete_words(s, table)) for s in stories if s]
    samples = json.loads((gv / "sample_stories.json").read_text(encoding="utf-8"))
    sample_nps = json.loads((gv / "sample_nphrases.json").read_text(encoding="utf-8"))
    rows += [("vist", "groovist_sample", samples[k], sample_nps[k]) for k in samples]
    out: dict = {"model": "ViT-B-32 architecture, random weights (no pretrained weights offline)",
                 "stories": len(rows), "frames": {k: len(v) for k, v in sets.items()}}
    common = {"clip_model": model, "clip_pretrained": None, "device": device}
    scores: dict = {}
    for p in ("exact", "fast"):
        clipscore = create_reward("clipscore", **common, image_pipeline=p)
        for dataset in sets:
            groovist = create_reward("groovist", **common, image_pipeline=p, regions="grid", theta=dataset,
                                     concreteness=str(gv / "concreteness_ratings.csv"),
                                     pronouns=str(gv / "all_pronouns.txt"))
            groovist.text_units_given = True  # noun phrases given: no spaCy pipeline
            mine = [r for r in rows if r[0] == dataset and r[3]]
            images = [sets[dataset]] * len(mine)
            texts = [r[2] for r in mine]
            scores[("groovist", p, dataset)] = groovist.score(texts, images=images, noun_phrases=[r[3] for r in mine])
            scores[("clipscore", p, dataset)] = clipscore.score(texts, images=images)
            scores[("systems", dataset)] = [r[1] for r in mine]
    for name in ("groovist", "clipscore"):
        diffs, system_gaps = [], {}
        for dataset in sets:
            exact, fast = (np.asarray(scores[(name, p, dataset)], dtype=np.float64) for p in ("exact", "fast"))
            diffs.append(np.abs(fast - exact))
            systems = np.asarray(scores[("systems", dataset)])
            means = {p: {s: float(np.nanmean(v[systems == s])) for s in ("gt_test", "llava_vc_p3")}
                     for p, v in (("exact", exact), ("fast", fast))}
            system_gaps[dataset] = {"exact": means["exact"], "fast": means["fast"],
                                    "same_order": (means["exact"]["gt_test"] > means["exact"]["llava_vc_p3"])
                                    == (means["fast"]["gt_test"] > means["fast"]["llava_vc_p3"])}
        diff = np.concatenate(diffs)
        out[name] = {"max_score_difference": float(np.nanmax(diff)), "mean_score_difference": float(np.nanmean(diff)),
                     "systems": system_gaps}
    return out


#: The smallest gaps between two systems' scores in the authors' papers and data
#: (the fast pipeline must stay far below them to leave every ranking as it is).
AUTHORS_GAPS = [
    ("GROOViST (bounded), AREL 0.348 vs GLAC Net 0.336, d_HM paper Fig. 2 (one VIST story)", 0.012),
    ("GROOViST (raw), human 0.858 vs LLaVA 0.840, mean over VWP test (authors' *_G.json)", 0.018),
    ("GROOViST (raw), the two sample stories 1.278 vs 1.241 (authors' sample_scores.json)", 0.037),
    ("d_HM, LLaVA 0.16 vs TAPM 0.214 on VIST (d_HM paper, section 4)", 0.054),
]
