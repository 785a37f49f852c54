"""Preference pairs for preference training (``storyrl pairs``), in TRL's
preference format: one JSON object per line with ``prompt``, ``chosen``,
``rejected`` and ``images`` (image paths, possibly empty), plus storyrl's
``story_id``, ``source``, ``chosen_score``, ``rejected_score`` and ``margin``,
and ``reference`` (the sequence's human story) where there is one: pairs
sampled from a policy, and story sets whose records carry a ``reference``
(``storyrl meta-eval pairs`` then scores ``dhm`` against it).

Two routes need no policy sampling:

* From people (:func:`human_pair_rows`): VHED's ranked pairs and VIST-Edit's
  edit-over-machine pairs, as :mod:`storyrl.judgements.pairs` and
  :mod:`storyrl.judgements.vist_edit` read them. The scores are null (people
  ranked, they did not score); ``margin`` is the human gap when the source has
  one (VHED's |rank gap|), else null.
* From a reward over existing stories (:func:`metric_pairs`): several story
  sets for the same records (matched by ``story_id``) are scored with one
  reward, and each record's best story is paired with each other story
  ("best vs each worse", not all pairs: every pair then teaches the preference
  for the story the reward likes most, and a record of k stories gives k-1
  pairs, not k(k-1)/2 pairs of ever smaller margins). A pair is kept when its
  margin (best score - other score) is above ``min_margin``; among equal best
  scores the story of the earlier set is the best. Dropped, with counted
  reasons: unscorable stories (NaN, or empty: a policy may sample an empty
  story, which some rewards score, and the trainers refuse), records with
  fewer than two scored stories, ties (margin 0) and pairs at or below
  ``min_margin``.

* From a policy (:func:`sample_stories`, :func:`policy_pairs`): k stories
  sampled per image sequence from a policy, prompted exactly as ``storyrl
  train rl`` prompts it (:func:`storyrl.training.storyteller.rl.data.prompt_rows`), are
  ranked the same way (best vs each worse), each scored with its sequence's
  context (``reference`` = the human story, so ``dhm`` measures the distance
  to it; the images). The row's ``prompt`` is the prompt the policy was
  sampled with: a string, or the conversation (TRL's conversational
  preference format) for chat models and VLMs. Each sequence is sampled
  alone from a seed of (``seed``, story id), so its samples do not depend
  on which other sequences are sampled in the same run: a resumed run
  gives the stories of an uninterrupted one. Sampled stories go to a
  sidecar file (:func:`open_samples`) as they are made. The stories are
  decoded text; a sampled story whose text does not encode back to the
  sampled tokens (:func:`round_trips`: some tokenizers' decoding is lossy,
  e.g. cleaned-up spaces) is counted, since a model later trained on the
  text sees other tokens than the policy made.

Without a policy the prompt is one text for every pair (``prompt``); the
images carry the sequence. Image paths this module finds (a policy's
sequences, VHED's ids under ``image_root``) are written absolute: the file
is read from other directories, by trainers whose own ``image_root`` is
their data's, not the pairs'.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from storyrl.data import StoryRecord
from storyrl.eval.scoring import score_context
from storyrl.judgements.pairs import PreferencePair

__all__ = ["DEFAULT_PROMPT", "DROP_REASONS", "human_pair_rows", "metric_pairs", "open_samples", "pair_row",
           "policy_pairs", "round_trips", "sample_stories", "samples_path"]

DEFAULT_PROMPT = "Write a story about this sequence of images."

#: Why a story, record or pair gave no kept pair (the summary's keys).
UNSCORABLE = "unscorable_stories"
SINGLE = "records_with_fewer_than_2_scored_stories"
TIE = "tied_pairs"
SMALL = "pairs_at_or_below_min_margin"
DROP_REASONS = (UNSCORABLE, SINGLE, TIE, SMALL)


def pair_row(*, prompt: str | list, chosen: str, rejected: str, images: Sequence[str] = (), story_id: str | None = None,
             source: str = "", chosen_score: float | None = None, rejected_score: float | None = None,
             margin: float | None = None, reference: str | None = None) -> dict[str, Any]:
    """One output line (module docstring); ``reference`` only when there is one."""
    row = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "images": list(images),
           "story_id": story_id, "source": source, "chosen_score": chosen_score,
           "rejected_score": rejected_score, "margin": margin}
    if reference is not None:
        row["reference"] = reference
    return row


def human_pair_rows(pairs: Sequence[PreferencePair], prompt: str = DEFAULT_PROMPT,
                    image_root: str | None = None) -> list[dict[str, Any]]:
    """Rows of human preference pairs: better = chosen, worse = rejected.
    A pair with image ids and no image paths (VHED) gets its images from
    ``image_root`` when one is given (ValueError naming the pair and the
    missing file otherwise)."""
    from storyrl.images import resolve_images

    rows = []
    for p in pairs:
        images = p.images or ()
        if not images and p.image_ids and image_root is not None:
            try:
                images = _absolute(resolve_images(None, p.image_ids, image_root))
            except ValueError as exc:
                raise ValueError(f"{p.source or p.story_id}: {exc}") from None
        rows.append(pair_row(prompt=prompt, chosen=p.better, rejected=p.worse, images=images, story_id=p.story_id,
                             source=p.source, margin=p.gap))
    return rows


def _scores(reward: Any, records: Sequence[StoryRecord], batch_size: int) -> list[float]:
    scores: list[float] = []
    for start in range(0, len(records), batch_size):
        batch = list(records[start:start + batch_size])
        values = reward.score([r.story for r in batch], **score_context(batch))
        scores += [float(v) for v in values]
    return scores


def _check_margin(min_margin: float) -> None:
    if isinstance(min_margin, bool) or not isinstance(min_margin, (int, float)) or not (
            math.isfinite(min_margin) and min_margin >= 0):
        raise ValueError(f"min_margin must be a finite number >= 0, got {min_margin!r}")


def _ranked_pairs(
    story_sets: Sequence[tuple[str, Sequence[StoryRecord]]],
    reward: Any,
    *,
    min_margin: float,
    prompt_of: Callable[[str, StoryRecord], Any],
    source_of: Callable[[str, str], str],
    batch_size: int,
) -> tuple[list[dict[str, Any]], Counter]:
    """Best-vs-each-worse pairs of ``story_sets`` (module docstring);
    ``prompt_of(story_id, best record)`` and ``source_of(best set, other
    set)`` fill a row's prompt and source."""
    _check_margin(min_margin)
    dropped = Counter({reason: 0 for reason in DROP_REASONS})
    candidates: dict[str, list[tuple[str, StoryRecord, float]]] = {}
    for name, records in story_sets:
        for record, score in zip(records, _scores(reward, records, batch_size)):
            found = candidates.setdefault(record.story_id, [])
            # An empty story is no preference to train on (the trainers refuse such a row), whatever its score.
            if math.isnan(score) or not record.story.strip():
                dropped[UNSCORABLE] += 1
            else:
                found.append((name, record, score))
    rows = []
    for story_id, found in candidates.items():
        if len(found) < 2:
            dropped[SINGLE] += 1
            continue
        best_name, best, best_score = max(found, key=lambda c: c[2])  # max keeps the first of equal scores
        # The sequence's human story (any set's record may carry it): meta-eval reads it as d_HM's reference.
        reference = next((r.reference for _, r, _ in found if isinstance(r.reference, str)), None)
        for name, other, score in found:
            if other is best:
                continue
            margin = best_score - score
            if margin == 0:
                dropped[TIE] += 1
            elif margin <= min_margin:
                dropped[SMALL] += 1
            else:
                rows.append(pair_row(prompt=prompt_of(story_id, best), chosen=best.story, rejected=other.story,
                                     images=best.images or (), story_id=story_id,
                                     source=source_of(best_name, name),
                                     chosen_score=best_score, rejected_score=score, margin=margin,
                                     reference=reference))
    return rows, dropped


def metric_pairs(
    story_sets: Sequence[tuple[str, Sequence[StoryRecord]]],
    reward: Any,
    *,
    min_margin: float = 0.0,
    prompt: str = DEFAULT_PROMPT,
    batch_size: int = 64,
) -> tuple[list[dict[str, Any]], Counter]:
    """Best-vs-each-worse pairs of ``story_sets`` ((name, records) each) by
    ``reward`` (module docstring). Returns the rows, records in order of
    first appearance, and the dropped counts by reason (every reason
    present, 0 when none)."""
    _check_margin(min_margin)
    if len(story_sets) < 2:
        raise ValueError(f"pairs from a metric need at least 2 story sets, got {len(story_sets)}")
    return _ranked_pairs(story_sets, reward, min_margin=min_margin, prompt_of=lambda story_id, best: prompt,
                         source_of=lambda best, other: f"{reward.name}: {best} > {other}", batch_size=batch_size)


# -- pairs sampled from a policy ---------------------------------------------------------

#: First line of a samples sidecar: this key, then the options digest.
SAMPLES_HEADER = "storyrl_pairs_samples"


def samples_path(out: str | Path) -> Path:
    """The samples sidecar of the pairs file ``out``: ``NAME.samples.jsonl`` next to it."""
    out = Path(out)
    return out.with_name(f"{out.stem}.samples.jsonl")


def _digest(options: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(options), sort_keys=True).encode("utf-8")).hexdigest()[:16]


def open_samples(path: str | Path, options: Mapping[str, Any], *, resume: bool, overwrite: bool):
    """Lock the samples sidecar ``path`` and return ``(locked output, {story_id:
    samples} already there)``. Fresh (no ``resume``): the file must be
    absent or empty unless ``overwrite`` (then it is emptied); its first
    line records ``options`` and their digest. With ``resume`` the stored
    samples are read back, provided they were made with the same
    ``options`` (else a one-line ValueError listing the options that
    differ); a last line cut by a kill is dropped (that sequence is sampled
    again). OutputError when another process holds the file."""
    from storyrl.output_files import LockedOutput

    path = Path(path)
    digest = _digest(options)
    header = json.dumps({SAMPLES_HEADER: digest, "options": dict(options)}, sort_keys=True) + "\n"
    if not resume:
        store = LockedOutput(path, existing="truncate" if overwrite else "refuse")
        store.write(header)
        return store, {}
    store = LockedOutput(path, existing="keep")
    try:
        complete, partial = store.read()
        if not complete:
            store.replace(header)
            return store, {}
        lines = complete.splitlines()
        try:
            first = json.loads(lines[0])
            stored_digest, stored = first[SAMPLES_HEADER], first["options"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}: not a storyrl pairs samples file (first line); use --overwrite to "
                             "sample again") from None
        if stored_digest != digest:
            differ = sorted(k for k in {*stored, *options} if stored.get(k) != options.get(k))
            raise ValueError(f"--resume: {path} was sampled with other options ({', '.join(differ) or 'digest'}); "
                             "give the same options, or --overwrite to sample again")
        done: dict[str, list[str]] = {}
        for number, line in enumerate(lines[1:], start=2):
            try:
                obj = json.loads(line)
                story_id, samples = obj["story_id"], obj["samples"]
                if not isinstance(samples, list) or not all(isinstance(t, str) for t in samples):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}: line {number}: not a sampled sequence; use --overwrite to "
                                 "sample again") from None
            done[str(story_id)] = samples
        if partial:
            store.replace(complete)
    except BaseException:
        store.close()
        raise
    return store, done


def _row_seed(seed: int, story_id: str) -> int:
    # One seed per sequence: its samples do not depend on the other sequences.
    return int.from_bytes(hashlib.sha256(f"{seed}\0{story_id}".encode()).digest()[:8], "big") >> 1


class _KeepIds:
    """The policy's model, keeping what its last ``generate`` call returned
    (the sampled token ids, which ``_generate`` decodes and drops)."""

    def __init__(self, model: Any) -> None:
        self._model, self.output, self.prompt_length = model, None, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def generate(self, **inputs: Any) -> Any:
        self.output = self._model.generate(**inputs)
        self.prompt_length = inputs["input_ids"].shape[1]
        return self.output


def round_trips(tokenizer: Any, ids: Sequence[int], text: str) -> bool:
    """Whether ``text`` (the decoded story) encodes back to the sampled
    ``ids`` without their special and pad tokens. When it does not, a model
    trained on the text (DPO, a reward model) sees other tokens than the
    policy sampled."""
    special = set(tokenizer.all_special_ids)
    if tokenizer.pad_token_id is not None:
        special.add(tokenizer.pad_token_id)
    sampled = [int(t) for t in ids if int(t) not in special]
    return list(tokenizer(text, add_special_tokens=False).input_ids) == sampled


def sample_stories(policy: Any, rows: Sequence[dict], k: int, *, store: Any = None,
                   done: Mapping[str, list[str]] | None = None, temperature: float = 1.0, top_p: float = 1.0,
                   max_new_tokens: int = 128, seed: int = 0, prepare: Callable[[dict], dict] | None = None,
                   show_progress: bool = True, counts: Counter | None = None) -> dict[str, list[str]]:
    """k sampled stories per prompt row (:func:`prompt_rows`' rows) of
    ``policy``, ``{story_id: [k stories]}``. Rows in ``done`` are not
    sampled again (their stories are reused); each newly sampled row is
    appended to ``store`` (a LockedOutput) as one line, flushed.
    ``prepare(row)`` gives the row the policy reads (e.g. a VLM's images
    loaded). ``counts`` (when given) gets ``sampled_stories`` and
    ``stories_not_round_tripping`` (:func:`round_trips`) added for the
    newly sampled stories."""
    import dataclasses

    import torch

    from storyrl.console import progress
    from storyrl.training.storyteller.rl.policy import _generate

    done = dict(done or {})
    todo = [row for row in rows if row["story_id"] not in done]
    out = {row["story_id"]: done[row["story_id"]] for row in rows if row["story_id"] in done}
    keep = _KeepIds(policy.model)
    watched = dataclasses.replace(policy, model=keep)
    with progress(total=len(todo), desc="sampling", unit="seq", disable=not show_progress) as bar:
        for row in todo:
            torch.manual_seed(_row_seed(seed, row["story_id"]))
            samples = _generate(watched, [prepare(row) if prepare else row], max_new_tokens, do_sample=True,
                                temperature=temperature, top_p=top_p, num_return_sequences=k)
            if counts is not None:
                new = keep.output[:, keep.prompt_length:].tolist()
                counts["sampled_stories"] += len(samples)
                counts["stories_not_round_tripping"] += sum(
                    not round_trips(policy.tokenizer, ids, text) for ids, text in zip(new, samples))
            out[row["story_id"]] = samples
            if store is not None:
                store.write(json.dumps({"story_id": row["story_id"], "samples": samples}, ensure_ascii=False) + "\n")
            bar.update(1)
    return {row["story_id"]: out[row["story_id"]] for row in rows}


def _absolute(images: Sequence[Any] | None) -> list[Any] | None:
    """Image paths made absolute: they were found from the current directory
    (``--image-root``), and the pairs file is read from others (a trainer's
    ``image_root`` is its ``data``'s, not the pairs')."""
    if images is None:
        return None
    return [os.path.abspath(p) if isinstance(p, (str, os.PathLike)) else p for p in images]


def policy_pairs(rows: Sequence[dict], samples: Mapping[str, Sequence[str]], reward: Any, *, source: str,
                 min_margin: float = 0.0, batch_size: int = 64) -> tuple[list[dict[str, Any]], Counter]:
    """Best-vs-each-worse pairs of each row's sampled stories (module
    docstring): the row's prompt, its images (``story_images``), its human
    story as ``reference`` context; ``source`` (the policy) then the reward
    and the sample numbers (1-based, in sampling order; among equal best
    scores the earlier sample is the best)."""
    k = max((len(s) for s in samples.values()), default=0)
    prompts = {row["story_id"]: row["prompt"] for row in rows}
    images = {row["story_id"]: _absolute(row.get("story_images")) for row in rows}
    sets = []
    for j in range(k):
        records = [StoryRecord(story_id=row["story_id"], story=samples[row["story_id"]][j],
                               images=images[row["story_id"]], image_ids=row.get("image_ids"),
                               reference=row.get("reference"))
                   for row in rows if len(samples[row["story_id"]]) > j]
        sets.append((f"sample {j + 1}", records))
    return _ranked_pairs(sets, reward, min_margin=min_margin, prompt_of=lambda story_id, best: prompts[story_id],
                         source_of=lambda best, other: f"{source}, {reward.name}: {best} > {other}",
                         batch_size=batch_size)
