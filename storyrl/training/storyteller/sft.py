"""Supervised fine-tuning of a storyteller on human stories: TRL's
``SFTTrainer`` (``storyrl train sft --config configs/training/sft.yaml``).

* The prompt of each image sequence is the one RL trains on and ``generate``
  sends (:func:`storyrl.training.storyteller.rl.data.build_dataset`: the generators'
  prompt template, a conversation when the tokenizer has a chat template);
  the completion is the human story (a record's ``reference``, else its
  ``story``). TRL's prompt/completion format with ``completion_only_loss``
  puts the loss on the story's tokens only.
* The policy loads as RL loads it (:func:`storyrl.training.storyteller.rl.policy.load_policy`,
  LoRA through :func:`~storyrl.training.storyteller.rl.policy.lora_config`), so
  ``OUTPUT_DIR/final`` (full weights, merged weights with ``lora.merge``, or
  adapters, with the tokenizer) is a ``storyrl train rl --model``.
* Causal LMs and image-text-to-text VLMs (LLaVA, LLaVA-NeXT, ...). A VLM's
  rows carry RL's ``images`` (the sequence image, or each image with
  ``setting: separate``), made when a row is read; TRL's vision collator
  puts them in the prompt and masks the prompt's tokens (image tokens
  included). ``freeze_vision_tower`` keeps the vision encoder's weights (and
  keeps adapters off it) as in RL. ``max_length`` cuts the end of prompt +
  story, so it must leave room for the prompt's image tokens. TAPM is
  refused (``storyrl train tapm`` trains it).
* ``precision`` is the weights' dtype and sets TRL's autocast
  (:meth:`~storyrl.training.storyteller.config.TrlRunOptions.trl_arguments`): bf16
  weights train under bf16 autocast; fp16 is an fp16 base under fp32 LoRA
  adapters (fp16 autocast + loss scaling, on the CPU as on a GPU); fp16
  without LoRA is refused when the config is read (no fp32 master copy).
* ``--resume`` continues from the latest complete ``checkpoint-<step>/``
  (weights, optimizer, scheduler, RNG states and data order); the result
  equals an uninterrupted run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storyrl.config import option
from storyrl.training import Trainer
from storyrl.training.runs import guarded
from storyrl.training.storyteller.config import (RunResult, StorytellerConfig, TrlRunOptions, match_precision,
                                         story_completion, turn_end)

__all__ = ["TRAINER", "SFTResult", "SFTRunConfig", "build_trainer", "sft_dataset", "train"]


@dataclass(kw_only=True)
class SFTRunConfig(TrlRunOptions, StorytellerConfig):
    """Settings of the sft trainer (module docs): the run keys of
    :class:`~storyrl.training.storyteller.config.TrlRunOptions` and the policy,
    data and prompt keys of :class:`~storyrl.training.storyteller.config.StorytellerConfig`,
    as ``storyrl train rl`` reads them."""

    _field_word = "key"

    batch_size: int = option(8, "Stories per device and step.", min=1)


@dataclass(kw_only=True)
class SFTResult(RunResult):
    """What a run did: optimizer steps, the log history, where the model is."""

    def summary(self) -> dict[str, Any]:  # what `storyrl train sft` prints
        losses = [e["loss"] for e in self.history if "loss" in e]
        return {**super().summary(), "last_loss": losses[-1] if losses else None}


def sft_dataset(config: SFTRunConfig, kind: str, processing_class: Any):
    """Prompt/completion rows: RL's prompt of each sequence and its human
    story. A VLM's rows keep RL's ``images`` (made when a row is read) and
    the ``story_id``/``story_images`` columns that make them."""
    from storyrl.training.storyteller.rl.data import build_dataset

    prompts = build_dataset(config, kind, processing_class)
    # RL's image transform renders sequence images when a row is read: map the
    # text columns without it (no image is made here), then put it back.
    transform = prompts.format["format_kwargs"].get("transform") if prompts.format["type"] == "custom" else None
    plain = prompts.with_format(None)
    end = turn_end(processing_class)

    def row(example: dict) -> dict:
        story = (example["reference"] or "").strip()
        if not story:
            raise ValueError(f"{config.data}: story {example['story_id']!r} has no human story to train on")
        return {"prompt": example["prompt"], "completion": story_completion(example["prompt"], story, end)}

    keep = {"story_id", "story_images"} if transform is not None else set()
    rows = plain.map(row, remove_columns=[c for c in plain.column_names if c not in keep])
    return rows if transform is None else rows.with_transform(transform)


def _sft_args(config: SFTRunConfig, progress: bool, kind: str):
    from trl import SFTConfig

    return SFTConfig(
        **config.trl_arguments(progress),
        completion_only_loss=True,  # the prompt is context, not something to learn
        # A VLM's rows carry the columns its images are made from; TRL's vision
        # collator reads prompt/completion/images only.
        remove_unused_columns=kind != "vlm",
    )


def build_trainer(config: SFTRunConfig, progress: bool = True, callbacks: list | None = None):
    """TRL's SFTTrainer of ``config`` (policy, dataset, LoRA), not yet trained."""
    import logging

    from trl import SFTTrainer

    from storyrl.training.storyteller.rl.policy import load_policy, lora_config
    from storyrl.training.storyteller.rl.trl_trainers import HistoryCallback, quiet_progress

    kind = config.policy_kind()
    if kind == "tapm":
        raise ValueError(f"model {config.model}: a TAPM model; storyrl train sft fine-tunes causal LMs and VLMs "
                         "only; train TAPM with storyrl train tapm")
    policy = load_policy(config, kind)
    policy.tokenizer.padding_side = "right"  # training: the story ends where its tokens end
    dataset = sft_dataset(config, kind, policy.processing_class)
    trainer = SFTTrainer(model=policy.model, args=_sft_args(config, progress, kind), train_dataset=dataset,
                         processing_class=policy.processing_class, peft_config=lora_config(config, kind),
                         callbacks=[HistoryCallback(config.output_dir), *(callbacks or [])])
    # TRL drops the rows whose story is cut off entirely (prompt >= max_length).
    kept, total = len(trainer.train_dataset), len(dataset)
    if kept == 0:
        raise ValueError(f"max_length {config.max_length}: no story fits after its prompt ({total} rows dropped); "
                         "raise max_length")
    if kept < total:
        logging.getLogger(__name__).warning("max_length %d: %d of %d stories do not fit after their prompt; they are "
                                            "left out", config.max_length, total - kept, total)
    quiet_progress(trainer, progress)
    match_precision(trainer)
    return trainer


@guarded
def train(config: SFTRunConfig, resume: bool = False, progress: bool = True) -> SFTResult:
    """Fine-tune, then save the model and its tokenizer in ``OUTPUT_DIR/final``."""
    from storyrl.training.storyteller.rl.trl_trainers import train_to_final

    trainer = train_to_final(config, build_trainer, resume, progress, "sft_config.yaml")
    return SFTResult(output_dir=config.output_dir, steps=trainer.state.global_step,
                     history=list(trainer.state.log_history))


TRAINER = Trainer(
    SFTRunConfig, train,
    outputs="Checkpoints OUTPUT_DIR/checkpoint-<step>, one JSON line per log in OUTPUT_DIR/history.jsonl and the "
            "model in OUTPUT_DIR/final (a storyrl train rl --model).",
    resume_help="Continue from the latest complete OUTPUT_DIR/checkpoint-<step>.",
)
