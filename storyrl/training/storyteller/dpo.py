"""Direct preference optimisation of a storyteller on story preference pairs:
TRL's ``DPOTrainer`` (``storyrl train dpo --config configs/training/dpo.yaml``).

* ``pairs`` is a JSONL of TRL preference rows as ``storyrl pairs`` writes
  them (``prompt``, ``chosen``, ``rejected``, ``images``, ``story_id``, ...).
  With ``prompts: template`` (the default) each pair's prompt is rebuilt as
  the storyteller prompt RL, SFT and ``generate`` send
  (:class:`storyrl.training.storyteller.rl.data._Prompter` with the pair's image count;
  a conversation when the tokenizer has a chat template), so DPO trains on
  the prompt the policy sees; ``prompts: pairs`` keeps the file's prompt.
  The loss is on the stories' tokens only (TRL's completion mask).
* The reference is the policy as it starts: with LoRA the base with the
  adapters disabled (no second copy), otherwise a frozen copy loaded as the
  policy is (TRL would reload it from the path, without revision or 4-bit).
* Monitoring as in RL runs: every ``sample_steps`` optimizer steps the
  current policy samples a story (temperature 1, as RL samples) for each of
  the first ``sample_prompts`` sequences of ``data``; each of ``rewards``
  scores them (context as RL gives it: the human story as reference, the
  sequence's images) and ``rewards/<name>/mean`` (over the stories a reward
  could score) with the story statistics of
  :func:`storyrl.training.storyteller.rl.monitor.story_stats` go into the step's log
  (``history.jsonl``) and the first three stories, with their story ids,
  into ``samples.jsonl``. Sampled, not greedy: a text policy's prompt
  depends only on the image count, so greedy decoding wrote one story for
  every sequence. The sampling is seeded by ``seed`` alone, the same draws
  at every monitoring step (the steps differ by the policy, not by luck;
  a resumed run samples what an uninterrupted one does), and leaves the
  training's random state as it was.
* ``precision`` is the weights' dtype and sets TRL's autocast
  (:meth:`~storyrl.training.storyteller.config.TrlRunOptions.trl_arguments`): bf16
  weights train under bf16 autocast; fp16 is an fp16 base under fp32 LoRA
  adapters (fp16 autocast + loss scaling, on the CPU as on a GPU); fp16
  without LoRA is refused when the config is read (no fp32 master copy).
* Checkpoints, ``--resume``, overwrite and the lock as ``storyrl train sft``;
  ``OUTPUT_DIR/final`` (full weights, merged weights with ``lora.merge``, or
  adapters, with the tokenizer and dpo_config.yaml) is a ``storyrl train rl
  --model`` and a ``storyrl generate`` model.
* Causal-LM and VLM policies (a VLM sees the pair's images as RL shows them:
  the sequence image, or each image with ``setting: separate``, made when
  the pairs are read; a pair whose story holds the image token's text,
  which the processor would read as an image, is left out with a warning);
  TAPM is refused.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyrl.config import option
from storyrl.training import Trainer
from storyrl.training.runs import guarded
from storyrl.training.storyteller.config import (RunResult, StorytellerConfig, TrlRunOptions, match_precision,
                                         story_completion, turn_end)

__all__ = ["LOSS_TYPES", "PROMPT_SOURCES", "TRAINER", "DPOResult", "DPORunConfig", "build_trainer", "dpo_dataset",
           "train"]

#: TRL 1.16 DPOConfig's loss types.
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
PROMPT_SOURCES = ("template", "pairs")


@dataclass(kw_only=True)
class DPORunConfig(TrlRunOptions, StorytellerConfig):
    """Settings of the dpo trainer (module docs); the policy, data and prompt
    keys are :class:`~storyrl.training.storyteller.config.StorytellerConfig`'s, as
    ``storyrl train rl`` reads them (``data``: the image sequences and human
    stories the monitoring samples are written for)."""

    _field_word = "key"

    output_dir: str = option(help="TRL's checkpoint-<step>/, history.jsonl, samples.jsonl and the model in final/.",
                             path="new-dir")
    pairs: str = option(help="Preference pairs JSONL (storyrl pairs: prompt, chosen, rejected, images, ...).",
                        path="file")
    prompts: str = option("template", "template = each pair's prompt rebuilt as the storyteller prompt RL and "
                          "generate send (prompt, prompts_file, the pair's image count); pairs = the file's prompt "
                          "as is.", choices=PROMPT_SOURCES)
    beta: float = option(0.1, "DPO beta: how far the policy may move from the reference.", min=0.0)
    loss_type: str = option("sigmoid", "TRL's DPO loss.", choices=LOSS_TYPES)
    max_steps: int | None = option(None, "Optimizer steps; default: epochs over the pairs.", min=1)
    epochs: float = option(1.0, "Passes over the pairs (when max_steps is not set).", min=0.0)
    learning_rate: float = option(1e-6, "AdamW learning rate.", min=0.0)
    batch_size: int = option(8, "Pairs per device and step.", min=1)
    # -- monitoring -----------------------------------------------------------------
    rewards: list[str | dict[str, Any]] = option(factory=list, help="Rewards that score the monitoring samples: "  # noqa: RUF009
                                                 "registered names, reward config YAML paths or mappings.")
    sample_steps: int | None = option(None, "Every N optimizer steps, sample (seeded) and score a story for each "
                                      "of sample_prompts sequences of data (none: no monitoring).", min=1)
    sample_prompts: int = option(4, "Sequences of data the monitoring stories are written for.", min=1)
    sample_max_new_tokens: int = option(128, "Token limit of a monitoring story.", min=1)

    def _problems(self) -> list[str]:
        from storyrl.training.storyteller.rl.config import reward_problems

        problems = []
        if not Path(self.pairs).is_file():
            problems.append(f"pairs: no such file {self.pairs}")
        problems += reward_problems(self.rewards, "history keys are per name")
        if self.rewards and self.sample_steps is None:
            problems.append("rewards: they score the monitoring samples; set sample_steps (every N steps)")
        kind = self.policy_kind(read_hub=False)
        if kind == "tapm":
            problems.append(_kind_refusal(self.model, kind))
        if kind == "vlm" and self.prompts != "template":
            problems.append("prompts: pairs: a VLM policy's prompt holds the images; use prompts: template")
        return super()._problems() + problems

    def build_rewards(self) -> list[Any]:
        from storyrl.rewards import build_reward

        return [build_reward(entry) for entry in self.rewards]


def _kind_refusal(model: str, kind: str) -> str:
    return (f"model {model}: a {kind} model; storyrl train dpo trains causal-LM and VLM storytellers (TAPM reads "
            "visual features TRL's DPOTrainer does not pass)")


@dataclass(kw_only=True)
class DPOResult(RunResult):
    """What a run did: optimizer steps, the log history, where the model is."""

    def summary(self) -> dict[str, Any]:  # what `storyrl train dpo` prints
        losses = [e["loss"] for e in self.history if "loss" in e]
        return {**super().summary(), "last_loss": losses[-1] if losses else None}


def dpo_dataset(config: DPORunConfig, kind: str, processing_class: Any):
    """TRL preference rows (prompt, chosen, rejected) of ``config.pairs``,
    the prompt as ``config.prompts`` says (module docs); no images column
    for a text policy, PIL images for a VLM."""
    from datasets import Dataset

    from storyrl.images import resolve_images
    from storyrl.judgements.pairs import read_preference_rows
    from storyrl.training.storyteller.rl.data import _Prompter

    if kind == "vlm" and config.prompts != "template":
        raise ValueError(f"{config.pairs}: prompts: pairs: a VLM policy's prompt holds the images; use prompts: "
                         "template")
    prompter = _Prompter(config, kind, processing_class) if config.prompts == "template" else None
    end = turn_end(processing_class)
    # A story holding the image token's text reads as an image placeholder to a VLM's processor (TRL then
    # stops: "Found N <image> tokens ... but no images"); a sampled story can (its decoded text need not
    # encode back to the sampled tokens, see storyrl pairs' stories_not_round_tripping).
    image_token = getattr(processing_class, "image_token", None) if kind == "vlm" else None
    rows, holding = [], []
    pairs = read_preference_rows(config.pairs)
    for pair in pairs:
        where = f"{config.pairs}: line {pair['_line']}"
        if image_token and (image_token in pair["chosen"] or image_token in pair["rejected"]):
            holding.append(pair["_line"])
            continue
        if prompter is not None:
            if not pair["images"]:
                raise ValueError(f"{where}: no images, so no template prompt (it needs the image count); give the "
                                 "pair its images or set prompts: pairs")
            prompt = prompter.prompt(len(pair["images"]))
        elif pair.get("prompt") is None:
            raise ValueError(f"{where}: no 'prompt' to train on; give the pairs their prompts or set prompts: "
                             "template")
        else:
            prompt = pair["prompt"]
        row = {"prompt": prompt, "chosen": story_completion(prompt, pair["chosen"], end),
               "rejected": story_completion(prompt, pair["rejected"], end)}
        if kind == "vlm":  # what the policy sees: the sequence image (or each image), as in RL
            try:
                paths = resolve_images(pair["images"], None, config.image_root)
                row["images"] = prompter.images(str(pair.get("story_id") or pair["_line"]), paths)
            except ValueError as exc:  # ImageError names the file
                raise ValueError(f"{where}: {exc}") from None
        rows.append(row)
    if holding:
        shown = ", ".join(map(str, holding[:5])) + (", ..." if len(holding) > 5 else "")
        if not rows:
            raise ValueError(f"{config.pairs}: every pair has a story holding the image token {image_token!r}, which "
                             "the VLM's processor reads as an image (line " + shown + "); nothing to train on")
        logging.getLogger(__name__).warning("%s: %d of %d pairs have a story holding the image token %r, which the "
                                            "VLM's processor reads as an image (line %s); they are left out",
                                            config.pairs, len(holding), len(pairs), image_token, shown)
    return Dataset.from_list(rows)


def _dpo_args(config: DPORunConfig, progress: bool):
    from trl import DPOConfig

    return DPOConfig(**config.trl_arguments(progress), beta=config.beta, loss_type=[config.loss_type])


class SampleMonitor:
    """Writes, scores and logs the monitoring stories (module docs). The
    trainer calls :meth:`due` at each step's end and merges :meth:`run`'s
    metrics into that step's log."""

    def __init__(self, config: DPORunConfig, kind: str, processing_class: Any, rewards: list[Any]) -> None:
        from storyrl.training.storyteller.rl.data import load_data, prompt_rows

        self.config, self.kind, self.rewards = config, kind, rewards
        records = load_data(config)[: config.sample_prompts]
        self.rows = prompt_rows(config, records, kind, processing_class)
        self.samples_path = Path(config.output_dir) / "samples.jsonl"

    def due(self, step: int) -> bool:
        return self.config.sample_steps is not None and step % self.config.sample_steps == 0

    def stories(self, model, processing_class) -> list[str]:
        """One story per row, sampled from the seed (module docs)."""
        import torch

        from storyrl.training.storyteller.rl.policy import Policy, _generate

        training = model.training
        model.eval()
        device = next(model.parameters()).device
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(self.config.seed)
                return _generate(Policy(model, processing_class, self.kind), self.rows,
                                 self.config.sample_max_new_tokens, do_sample=True)
        finally:
            model.train(training)

    def run(self, model, processing_class, step: int, is_main: bool = True) -> dict[str, float]:
        from storyrl.training.storyteller.rl.monitor import finite_or_none, sample_stories, story_stats

        texts = self.stories(model, processing_class)
        metrics: dict[str, float] = {}

        def log_metric(name: str, value: float) -> None:
            metrics[name] = value

        context = {"reference": [r["reference"] for r in self.rows], "story_id": [r["story_id"] for r in self.rows]}
        if "story_images" in self.rows[0]:
            context["story_images"] = [r["story_images"] for r in self.rows]
        values = {}
        for reward in self.rewards:
            name = getattr(reward, "__name__", type(reward).__name__)
            scores = reward(prompts=[r["prompt"] for r in self.rows], completions=texts, log_metric=log_metric,
                            **context)
            values[name] = scores
            finite = [s for s in scores if s is not None and math.isfinite(s)]
            metrics[f"rewards/{name}/mean"] = sum(finite) / len(finite) if finite else math.nan
        metrics.update({k: v for k, v in story_stats(texts).items() if math.isfinite(v)})
        if is_main:
            totals = [sum(v[k] for v in values.values() if v[k] is not None) if any(
                v[k] is not None for v in values.values()) else math.nan for k in range(len(texts))]
            samples = sample_stories(texts, totals, 3)
            for k, sample in enumerate(samples):
                sample["story_id"] = self.rows[k]["story_id"]
                sample["rewards"] = {name: finite_or_none(v[k]) for name, v in values.items()}
            self.samples_path.parent.mkdir(parents=True, exist_ok=True)
            with self.samples_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "samples": samples}, ensure_ascii=False) + "\n")
        return metrics


def _monitored(trainer_class: type) -> type:
    """``trainer_class`` whose steps run the :class:`SampleMonitor` when due:
    the metrics join that step's log entry (so a checkpoint's log history,
    and history.jsonl after a resume, keep them)."""
    from transformers import TrainerCallback

    class SampleCallback(TrainerCallback):
        def __init__(self, trainer) -> None:
            self.trainer = trainer

        def on_step_end(self, args, state, control, **kwargs):
            trainer = self.trainer
            if trainer.sample_monitor is not None and trainer.sample_monitor.due(state.global_step):
                trainer.pending_metrics = trainer.sample_monitor.run(
                    trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class, state.global_step,
                    is_main=state.is_world_process_zero)
                control.should_log = True  # this step's entry carries them

    class Monitored(trainer_class):
        def __init__(self, *args, sample_monitor: SampleMonitor | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.sample_monitor, self.pending_metrics = sample_monitor, {}
            if sample_monitor is not None:
                self.add_callback(SampleCallback(self))

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if self.pending_metrics and self.model.training:
                logs.update(self.pending_metrics)
                self.pending_metrics = {}
            super().log(logs, start_time)

    Monitored.__name__ = Monitored.__qualname__ = trainer_class.__name__
    return Monitored


def build_trainer(config: DPORunConfig, progress: bool = True, callbacks: list | None = None):
    """TRL's DPOTrainer of ``config`` (policy, reference, pairs, LoRA,
    monitoring), not yet trained."""
    from trl import DPOTrainer

    from storyrl.training.storyteller.rl.policy import load_policy, lora_config
    from storyrl.training.storyteller.rl.trl_trainers import HistoryCallback, quiet_progress

    kind = config.policy_kind()
    if kind not in ("causal_lm", "vlm"):
        raise ValueError(_kind_refusal(config.model, kind))
    policy = load_policy(config, kind)
    dataset = dpo_dataset(config, kind, policy.processing_class)
    peft = lora_config(config, kind)
    # Without LoRA the reference is a frozen copy loaded as the policy was
    # (TRL would reload it from the config's path, without revision or 4-bit).
    reference = None if peft is not None else load_policy(config, kind).model.requires_grad_(False).eval()
    monitor = SampleMonitor(config, kind, policy.processing_class, config.build_rewards()) \
        if config.sample_steps is not None else None
    trainer = _monitored(DPOTrainer)(
        model=policy.model, ref_model=reference, args=_dpo_args(config, progress), train_dataset=dataset,
        processing_class=policy.processing_class, peft_config=peft, sample_monitor=monitor,
        callbacks=[HistoryCallback(config.output_dir), *(callbacks or [])])
    quiet_progress(trainer, progress)
    match_precision(trainer)
    return trainer


@guarded
def train(config: DPORunConfig, resume: bool = False, progress: bool = True) -> DPOResult:
    """Train, then save the model and its tokenizer in ``OUTPUT_DIR/final``."""
    from storyrl.training.storyteller.rl.trl_trainers import train_to_final

    trainer = train_to_final(config, build_trainer, resume, progress, "dpo_config.yaml")
    return DPOResult(output_dir=config.output_dir, steps=trainer.state.global_step,
                     history=list(trainer.state.log_history))


TRAINER = Trainer(
    DPORunConfig, train,
    outputs="Checkpoints OUTPUT_DIR/checkpoint-<step>, one JSON line per log in OUTPUT_DIR/history.jsonl, "
            "monitoring stories in OUTPUT_DIR/samples.jsonl and the model in OUTPUT_DIR/final (a storyrl train rl "
            "--model).",
    resume_help="Continue from the latest complete OUTPUT_DIR/checkpoint-<step>.",
)
