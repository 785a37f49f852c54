"""How far a fine-tuned storyteller has drifted from its start, along its own
stories (``storyrl kl``).

For each story a vision-language model generated (``storyrl generate``,
the ``visual`` setting), the prompt and sequence image it was generated
from are rebuilt from the story file's sidecar, the story is appended to
the prompt (after one space, as the model continued the prompt) with the
end-of-sequence token, and both models read it:

    KL(story) = sum over the story's tokens t of KL(p_policy(. | < t) || p_reference(. | < t))

the exact KL of the two next-token distributions (temperature 1, all of
the vocabulary) at every position that predicts a story token, the
end-of-sequence token included; nats per story. The story is re-tokenized
from its text, so where decoding is lossy the tokens can differ a little
from those the model produced. :func:`sequence_kl` is the computation on
loaded models (batched, left-padded, each row's positions counted from its
first real token); :func:`story_kl` loads the models and rebuilds the
prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from storyrl.data import StoryRecord

__all__ = ["KL_COLUMN", "prompting_options", "sequence_kl", "story_kl", "story_problem"]

#: The score column ``storyrl kl`` writes (``storyrl compare`` reports its mean).
KL_COLUMN = "kl"


def _inputs(processor, images: Sequence[Any], texts: Sequence[str], device):
    batch = processor(images=list(images), text=list(texts), return_tensors="pt", padding=True)
    return batch.to(device)


def story_problem(processor, story: str) -> str | None:
    """Why ``story`` cannot be measured, or None: a story holding the
    processor's image placeholder text would be read as one more image."""
    from storyrl.generators.prompting import processor_image_token

    token = processor_image_token(processor)
    return f"the story contains the image token {token}" if token and token in story else None


def sequence_kl(policy, reference, processor, prompts: Sequence[str], images: Sequence[Any],
                stories: Sequence[str], *, batch_size: int = 4, device: Any = "cpu") -> list[float]:
    """KL(policy || reference) summed over each story's tokens (module docs),
    ``policy`` and ``reference`` two models that share ``processor`` (its
    tokenizer pads on the left). One value per (prompt, image, story); NaN
    for a story :func:`story_problem` refuses."""
    import torch

    from storyrl.generators.engines import pixel_dtype

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not len(prompts) == len(images) == len(stories):
        raise ValueError("prompts, images and stories must be as many")
    tokenizer = getattr(processor, "tokenizer", processor)
    if tokenizer.padding_side != "left":
        raise ValueError("the processor's tokenizer must pad on the left")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end-of-sequence token")
    out = [math.nan] * len(stories)
    todo = [i for i, story in enumerate(stories) if story_problem(processor, story) is None]
    for start in range(0, len(todo), batch_size):
        rows = todo[start : start + batch_size]
        batch_images = [images[i] for i in rows]
        alone = _inputs(processor, batch_images, [prompts[i] for i in rows], device)
        full = _inputs(processor, batch_images, [f"{prompts[i]} {stories[i]}" for i in rows], device)
        prompt_len = alone["attention_mask"].sum(-1)
        # the story's tokens and the end-of-sequence token, at the end of each left-padded row
        story_len = full["attention_mask"].sum(-1) - prompt_len + 1
        ids = torch.cat([full["input_ids"], torch.full_like(full["input_ids"][:, :1], eos)], dim=1)
        mask = torch.cat([full["attention_mask"], torch.ones_like(full["attention_mask"][:, :1])], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = int(story_len.max()) + 1  # the logits predicting each story token, and one before
        extra = {k: v for k, v in full.items() if k not in ("input_ids", "attention_mask")}
        logp = []
        with torch.inference_mode():
            for model in (policy, reference):
                if "pixel_values" in extra and extra["pixel_values"].is_floating_point():
                    extra["pixel_values"] = extra["pixel_values"].to(pixel_dtype(model))  # the vision tower's
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep,
                               **extra).logits[:, -keep:]
                logp.append(torch.log_softmax(logits.float(), dim=-1))
        # (rows, keep): position j predicts j+1; a KL is >= 0, below only by rounding
        per_position = (logp[0].exp() * (logp[0] - logp[1])).sum(-1).clamp(min=0)
        for row, (i, n) in enumerate(zip(rows, story_len.tolist())):
            out[i] = float(per_position[row, keep - 1 - n : keep - 1].sum())
    return out


def prompting_options(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The prompting generator's options a story file's sidecar records,
    with the chat format the run resolved; ValueError when the file was not
    made by the prompting generator in the ``visual`` setting."""
    if meta.get("generator") != "prompting":
        raise ValueError(f"the stories were made by the {meta.get('generator')!r} generator; KL needs the "
                         "prompting generator's prompts")
    options = dict(meta.get("options") or {})
    if options.get("setting") != "visual":
        raise ValueError(f"the stories were made in the {options.get('setting')!r} setting (one call per image); "
                         "KL is defined for the visual setting's one prompt per story")
    if meta.get("chat_format"):
        options["chat_format"] = meta["chat_format"]
    return options


def story_kl(stories: Mapping[str, str], records: Sequence[StoryRecord], options: Mapping[str, Any], *,
             reference: str, policy: str | None = None, batch_size: int = 4,
             progress: Callable[[int], Any] | None = None, done: Callable[[list[str], list[float]], Any] | None = None,
             ) -> dict[str, float]:
    """KL of the model that wrote ``stories`` ({story_id: story}) to
    ``reference`` along them. ``options`` are the prompting generator's
    (:func:`prompting_options`; ``device`` and ``precision`` may be changed):
    the policy (``policy``, default ``options["model"]``) loads as that run
    loaded it, the reference (a hub name or directory) with the same device,
    precision and 4-bit setting, and each story is prompted as the run
    prompted the record of its story id. ``done(ids, values)`` is called
    after each batch (to write rows as they come)."""
    from storyrl.generators.prompting import PromptingConfig, PromptingGenerator
    from storyrl.images import resolve_images
    from storyrl.models.vlm import load_vlm

    config = PromptingConfig.from_mapping({**options, "backend": "transformers",
                                           **({"model": policy} if policy is not None else {})})
    generator = PromptingGenerator(config)
    by_id = {r.story_id: r for r in records}
    missing = [sid for sid in stories if sid not in by_id]
    if missing:
        raise ValueError(f"story {missing[0]!r} is not in the data ({len(missing)} stories are not)")
    generator.setup()  # the policy, loaded as `storyrl generate` loads it
    policy_vlm = generator._engine.vlm
    reference_vlm = load_vlm(reference, None, config.device, config.precision, config.load_in_4bit)
    ids = list(stories)
    out: dict[str, float] = {}
    for start in range(0, len(ids), batch_size):
        chunk = ids[start : start + batch_size]
        prompts, images = [], []
        for sid in chunk:
            record = by_id[sid]
            sequence = resolve_images(record.images, record.image_ids, config.image_root)
            prompts.append(generator.wrap(generator.prompt_text(len(sequence))))
            images.append(generator._sequence_image(record, sequence))
        values = sequence_kl(policy_vlm.model, reference_vlm.model, policy_vlm.processor, prompts, images,
                             [stories[sid] for sid in chunk], batch_size=batch_size, device=policy_vlm.device)
        out.update(zip(chunk, values))
        if done is not None:
            done(chunk, values)
        if progress is not None:
            progress(len(chunk))
    return out
