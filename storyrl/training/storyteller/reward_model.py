"""A story reward model from preference pairs: TRL's ``RewardTrainer``
(Bradley-Terry: loss = -log sigmoid(r_chosen - r_rejected)) on a pairs JSONL
as ``storyrl pairs`` writes it (``storyrl train reward_model --config
configs/training/reward_model.yaml``).

* The backbone is a text model loaded as ``AutoModelForSequenceClassification``
  with one output (a causal LM gets a fresh score head). TRL 1.16's
  RewardTrainer tokenizes text only (no images reach the model), so
  vision-language backbones are refused.
* Each story is scored as the ``reward_model`` reward scores it
  (:mod:`storyrl.rewards.reward_model`): with ``include_prompt`` the pairs'
  prompt, a space and the story, else the story alone; TRL's EOS appended;
  cut to ``max_length`` tokens. The pairs' one prompt may be a conversation
  (``storyrl pairs --policy`` with a chat model or VLM): it is rendered once
  here as text (:func:`~storyrl.rewards.reward_model.prompt_text`: the
  backbone's chat template, text parts only) and that text is what
  ``storyrl_reward_model.json`` keeps, so the reward prepends the very text
  the model trained on. The pairs are tokenized here, so TRL drops none of
  them for length.
* ``eval_fraction`` of the image sequences (pairs grouped by ``story_id``, a
  pair without one is its own group; the choice is seeded) is held out: they
  are written to ``OUTPUT_DIR/heldout_pairs.jsonl`` (a ``storyrl meta-eval
  pairs --pairs`` file) and the trained model's pair accuracy on them
  (chosen scored strictly above rejected) is in the summary and the last
  line of ``history.jsonl``.
* ``precision`` is the weights' dtype and sets TRL's autocast
  (:meth:`~storyrl.training.storyteller.config.TrlRunOptions.trl_arguments`): bf16
  weights train under bf16 autocast; fp16 is an fp16 base under fp32 LoRA
  adapters (fp16 autocast + loss scaling, on the CPU as on a GPU); fp16
  without LoRA is refused when the config is read (no fp32 master copy).
  With LoRA the new score head trains in fp32 beside the adapters.
* ``OUTPUT_DIR/final``: the model (merged weights, or LoRA adapters when
  ``lora.merge`` is false), its tokenizer, ``storyrl_reward_model.json`` (how to
  score) and ``reward_model_config.yaml``: a ``reward_model --model``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyrl.config import option
from storyrl.models.runtime import PRECISIONS
from storyrl.training import Trainer
from storyrl.training.runs import guarded
from storyrl.training.storyteller.config import LoraOptions, RunResult, TrlRunOptions, match_precision

__all__ = ["HELDOUT_FILE", "TRAINER", "RewardModelResult", "RewardModelRunConfig", "build_trainer", "read_pairs",
           "split_pairs", "train"]

CONFIG_FILE = "reward_model_config.yaml"  # written last into final/: a finished run
HELDOUT_FILE = "heldout_pairs.jsonl"


@dataclass(kw_only=True)
class RewardModelRunConfig(TrlRunOptions):
    """Settings of the reward_model trainer (module docs)."""

    _field_word = "key"

    model: str = option(help="Backbone: hub name or local directory of a text model (a causal LM or an encoder); "
                        "it gets a one-output sequence-classification head.")
    revision: str | None = option(None, "Hub revision of the model (branch, tag or commit).")
    precision: str = option("auto", "Weights dtype: auto = bf16 on a CUDA GPU that supports it, else fp32; fp16 "
                            "needs LoRA (fp32 adapters and score head).", choices=PRECISIONS)
    pairs: str = option(help="Preference pairs JSONL (storyrl pairs): prompt, chosen, rejected, story_id, ...",
                        path="file")
    include_prompt: bool = option(True, "Score the pairs' prompt, a space and the story (TRL's prompt + completion); "
                                  "false: the story alone. True needs one prompt shared by all pairs (a "
                                  "conversation is rendered with the model's chat template, its text only).")
    eval_fraction: float = option(0.1, "Share of image sequences (story_id) held out for pair accuracy; 0 = none.",
                                  min=0.0, max=0.9)
    output_dir: str = option(help="TRL's checkpoint-<step>/, history.jsonl, heldout_pairs.jsonl and the model in "
                             "final/.", path="new-dir")
    seed: int = option(0, "Seed of the run (held-out split, head initialisation, data order).")
    max_steps: int | None = option(None, "Optimizer steps; default: epochs over the pairs.", min=1)
    epochs: float = option(1.0, "Passes over the pairs (when max_steps is not set).", min=0.0)
    learning_rate: float = option(1e-5, "AdamW learning rate.", min=0.0)
    batch_size: int = option(8, "Pairs per device and step.", min=1)
    max_length: int = option(512, "Tokens of (prompt +) story; longer ones lose their end.", min=2)
    lora: LoraOptions = option(factory=LoraOptions, help="LoRA adapters: enabled, r, alpha, dropout, "  # noqa: RUF009
                               "target_modules, merge.", cli=False)

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if not Path(self.pairs).is_file():
            problems.append(f"pairs: no such file {self.pairs}")
        from storyrl.training.storyteller.rl.policy import detect_policy

        if detect_policy(self.model, self.revision, read_hub=False) in ("vlm", "tapm"):
            problems.append(_refusal(self.model))
        return problems


def _refusal(model: str) -> str:
    return (f"model {model}: not a text model; TRL's RewardTrainer scores text only (no images), so give a "
            "causal LM or text encoder")


@dataclass(kw_only=True)
class RewardModelResult(RunResult):
    """A run: steps, log history, final/, and the held-out pair accuracy."""

    heldout_pairs: int = 0
    heldout_accuracy: float | None = None

    def summary(self) -> dict[str, Any]:  # what `storyrl train reward_model` prints
        losses = [e["loss"] for e in self.history if "loss" in e]
        return {**super().summary(), "last_loss": losses[-1] if losses else None,
                "heldout_pairs": self.heldout_pairs, "heldout_accuracy": self.heldout_accuracy}


def read_pairs(path: str | Path) -> list[dict[str, Any]]:
    """The pairs of a JSONL file (:func:`storyrl.judgements.pairs.read_preference_rows`)."""
    from storyrl.judgements.pairs import read_preference_rows

    return read_preference_rows(path)


def shared_prompt(rows: list[dict[str, Any]], path: str) -> str | list[dict[str, Any]]:
    """The one prompt of the pairs, a text or a conversation (ValueError
    naming the line otherwise): the reward scores stories without a prompt
    of their own, so it prepends this one."""
    for row in rows:
        if row.get("prompt") is None:
            raise ValueError(f"pairs {path}: line {row['_line']}: no 'prompt' (include_prompt: true scores the "
                             "pairs' prompt before each story); give the pairs their prompt or set include_prompt: "
                             "false")
    first = rows[0]
    key = json.dumps(first["prompt"], sort_keys=True)
    for row in rows[1:]:
        if json.dumps(row["prompt"], sort_keys=True) != key:
            raise ValueError(f"pairs {path}: include_prompt needs one prompt shared by every pair, but line "
                             f"{first['_line']} and line {row['_line']} differ ({_shown(first['prompt'])} vs "
                             f"{_shown(row['prompt'])}); set include_prompt: false")
    return first["prompt"]


def _shown(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def split_pairs(rows: list[dict[str, Any]], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): ``fraction`` of the groups (story_id; a pair without
    one is its own group), chosen by ``seed``, held out; at least one group
    when fraction > 0 and there are two or more groups."""
    groups = sorted({row.get("story_id") or f"\0line {row['_line']}" for row in rows})
    if fraction == 0 or len(groups) < 2:
        return list(rows), []
    random.Random(seed).shuffle(groups)
    held = set(groups[:min(len(groups) - 1, max(1, round(fraction * len(groups))))])
    train = [r for r in rows if (r.get("story_id") or f"\0line {r['_line']}") not in held]
    return train, [r for r in rows if (r.get("story_id") or f"\0line {r['_line']}") in held]


def _dataset(rows: list[dict], tokenizer: Any, prompt: str | None, max_length: int):
    from datasets import Dataset

    from storyrl.rewards.reward_model import encode, scored_text

    return Dataset.from_list([{"chosen_ids": encode(tokenizer, scored_text(r["chosen"], prompt), max_length),
                               "rejected_ids": encode(tokenizer, scored_text(r["rejected"], prompt), max_length)}
                              for r in rows])


def _args(config: RewardModelRunConfig, progress: bool):
    from trl import RewardConfig

    return RewardConfig(**config.trl_arguments(progress))


def _lora(config: RewardModelRunConfig):
    if not config.lora.enabled:
        return None
    from peft import LoraConfig

    options = config.lora
    # SEQ_CLS: peft trains (and saves) the new score head in full beside the adapters.
    return LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout,
                      target_modules=options.target_modules, task_type="SEQ_CLS", revision=config.revision)


def load_backbone(config: RewardModelRunConfig):
    """(model with a one-output head, tokenizer) of ``config.model``, seeded."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    from storyrl.models.pretrained import load_pretrained
    from storyrl.training.storyteller.rl.policy import detect_policy, training_dtype

    if detect_policy(config.model, config.revision) in ("vlm", "tapm"):
        raise ValueError(_refusal(config.model))
    set_seed(config.seed)  # the score head is new: its initialisation follows the seed
    tokenizer = AutoTokenizer.from_pretrained(config.model, revision=config.revision)
    model = load_pretrained(AutoModelForSequenceClassification, config.model, revision=config.revision,
                            num_labels=1, dtype=training_dtype(config.precision))
    if tokenizer.pad_token is None:  # as TRL does: EOS pads
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def build_trainer(config: RewardModelRunConfig, progress: bool = True, callbacks: list | None = None):
    """(TRL's RewardTrainer, held-out rows, prompt or None), not yet trained."""
    import torch
    from trl import RewardTrainer

    from storyrl.training.storyteller.rl.trl_trainers import HistoryCallback, quiet_progress

    from storyrl.rewards.reward_model import prompt_text

    rows = read_pairs(config.pairs)
    pairs_prompt = shared_prompt(rows, config.pairs) if config.include_prompt else None
    train_rows, held = split_pairs(rows, config.eval_fraction, config.seed)
    model, tokenizer = load_backbone(config)
    try:
        prompt = None if pairs_prompt is None else prompt_text(pairs_prompt, tokenizer)
    except ValueError as exc:
        raise ValueError(f"pairs {config.pairs}: {exc}") from None
    trainer = RewardTrainer(model=model, args=_args(config, progress),
                            train_dataset=_dataset(train_rows, tokenizer, prompt, config.max_length),
                            processing_class=tokenizer, peft_config=_lora(config),
                            callbacks=[HistoryCallback(config.output_dir), *(callbacks or [])])
    if config.lora.enabled:
        # peft trains a copy of the new score head beside the adapters, in the
        # base's dtype: fp16 weights the GradScaler refuses to unscale. Like
        # the adapters it trains in fp32 (autocast casts for the forward).
        for param in trainer.model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    quiet_progress(trainer, progress)
    match_precision(trainer)
    return trainer, held, prompt


def pair_accuracy(model: Any, tokenizer: Any, rows: list[dict], prompt: str | None, max_length: int) -> float | None:
    """Share of ``rows`` whose chosen story the model scores strictly above
    the rejected one, scored as the reward scores (None without rows)."""
    if not rows:
        return None
    import torch

    from storyrl.rewards.reward_model import score_texts, scored_text

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts = [scored_text(r[k], prompt) for r in rows for k in ("chosen", "rejected")]
    scores = score_texts(model, tokenizer, texts, max_length, 16, device, torch.float32)
    model.train(was_training)
    return float(sum(scores[0::2] > scores[1::2]) / len(rows))


@guarded
def train(config: RewardModelRunConfig, resume: bool = False, progress: bool = True) -> RewardModelResult:
    """Train, then save the model, its tokenizer and how to score in ``OUTPUT_DIR/final``."""
    from storyrl.rewards.reward_model import METADATA_FILE
    from storyrl.training.guards import finished_history
    from storyrl.training.storyteller.rl.trl_guards import resume_checkpoint, run_training

    checkpoint = resume_checkpoint(config.output_dir, resume, config.max_steps)
    history = finished_history(config, CONFIG_FILE) if resume else None
    if history is not None and "heldout_pairs" in history[-1]:  # this run had finished: nothing to do
        last = history[-1]
        return RewardModelResult(output_dir=config.output_dir, steps=last["step"], history=history,
                                 heldout_pairs=last["heldout_pairs"], heldout_accuracy=last.get("heldout_accuracy"))
    trainer, held, prompt = build_trainer(config, progress)
    main = trainer.is_world_process_zero()
    output = Path(config.output_dir)
    if main:
        output.mkdir(parents=True, exist_ok=True)
        (output / HELDOUT_FILE).write_text("".join(json.dumps({k: v for k, v in r.items() if k != "_line"}) + "\n"
                                                   for r in held), encoding="utf-8")
    run_training(trainer, checkpoint)
    model = trainer.accelerator.unwrap_model(trainer.model)
    accuracy = pair_accuracy(model, trainer.processing_class, held, prompt, config.max_length)
    final = output / "final"
    if config.lora.enabled and config.lora.merge:
        model = model.merge_and_unload()
        if main:
            model.save_pretrained(final)
    else:
        trainer.save_model(str(final))
    history = list(trainer.state.log_history)
    if main:
        trainer.processing_class.save_pretrained(final)
        (final / METADATA_FILE).write_text(json.dumps(
            {"max_length": config.max_length, "include_prompt": config.include_prompt, "prompt": prompt,
             "pairs": config.pairs}, indent=1), encoding="utf-8")
        from storyrl.training.model_card import write_model_card

        write_model_card(final, config, "reward_model", steps=trainer.state.global_step)
        config.to_yaml(final / CONFIG_FILE)
        entry = {"heldout_pairs": len(held), "heldout_accuracy": accuracy, "step": trainer.state.global_step}
        with (output / "history.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        history.append(entry)
    return RewardModelResult(output_dir=config.output_dir, steps=trainer.state.global_step, history=history,
                             heldout_pairs=len(held), heldout_accuracy=accuracy)


TRAINER = Trainer(
    RewardModelRunConfig, train,
    outputs="Checkpoints OUTPUT_DIR/checkpoint-<step>, one JSON line per log in OUTPUT_DIR/history.jsonl, the "
            "held-out pairs in OUTPUT_DIR/heldout_pairs.jsonl and the model in OUTPUT_DIR/final (a reward_model "
            "--model).",
    resume_help="Continue from the latest complete OUTPUT_DIR/checkpoint-<step>.",
)
