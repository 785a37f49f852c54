"""Supervised fine-tuning of a storyteller on human stories: TRL's
``SFTTrainer`` (``storyrl train sft --config configs/training/sft.yaml``).

* The prompt of each image sequence is the one RL trains on and ``generate``
  sends (:func:`storyrl.training.rl.data.build_dataset`: the generators'
  prompt template, a conversation when the tokenizer has a chat template);
  the completion is the human story (a record's ``reference``, else its
  ``story``). TRL's prompt/completion format with ``completion_only_loss``
  puts the loss on the story's tokens only.
* The policy loads as RL loads it (:func:`storyrl.training.rl.policy.load_policy`,
  LoRA through :func:`~storyrl.training.rl.policy.lora_config`), so
  ``OUTPUT_DIR/final`` (full weights, merged weights with ``lora.merge``, or
  adapters, with the tokenizer) is a ``storyrl train rl --model``.
* Text policies (causal LMs) only for now; VLMs and TAPM are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storyrl.config import Config, ConfigTypeError, option
from storyrl.datasets import DATA_FORMATS
from storyrl.models.runtime import PRECISIONS
from storyrl.training import Trainer
from storyrl.training.runs import guarded

__all__ = ["TRAINER", "SFTResult", "SFTRunConfig", "build_trainer", "sft_dataset", "train"]

SETTINGS = ("auto", "text")


def _lora_options():
    from storyrl.training.rl.config import LoraOptions

    return LoraOptions()


@dataclass(kw_only=True)
class SFTRunConfig(Config):
    """Settings of the sft trainer (module docs)."""

    _field_word = "key"

    output_dir: str = option(help="TRL's checkpoint-<step>/, history.jsonl and the model in final/.", path="new-dir")
    seed: int = option(0, "Seed of the run (data order, adapter initialisation).")
    max_steps: int | None = option(None, "Optimizer steps; default: epochs over the data.", min=1)
    epochs: float = option(1.0, "Passes over the data (when max_steps is not set).", min=0.0)
    learning_rate: float = option(2e-5, "AdamW learning rate.", min=0.0)
    batch_size: int = option(8, "Stories per device and step.", min=1)
    gradient_accumulation_steps: int = option(1, "Batches per optimizer step.", min=1)
    max_length: int = option(1024, "Tokens of prompt + story; longer ones lose their end.", min=1)
    logging_steps: int = option(10, "Log (and write history.jsonl) every N steps.", min=1)
    save_steps: int = option(500, "Write checkpoint-<step>/ every N steps.", min=1)
    report_to: str | list[str] = option("none", "Trackers: tensorboard, wandb, ... (a name or a list), all or "  # noqa: RUF009
                                        "none.")
    # -- policy (as storyrl train rl loads it) --------------------------------------
    model: str = option(help="Hub name or local directory of the causal LM to fine-tune.")
    revision: str | None = option(None, "Hub revision of the model (branch, tag or commit).")
    precision: str = option("auto", "Weights dtype: auto = bf16 on a CUDA GPU that supports it, else fp32.",
                            choices=PRECISIONS)
    load_in_4bit: bool = option(False, "Load the base model in 4 bit (bitsandbytes NF4, CUDA); needs LoRA.")
    lora: Any = option(factory=_lora_options,  # noqa: RUF009  (option() is a dataclass field)
                       help="LoRA adapters: enabled, r, alpha, dropout, target_modules, "
                       "merge.", cli=False)
    # -- data and prompts (as storyrl train rl reads them) ---------------------------
    data: str = option(help="Image sequences with their human stories: VIST story-in-sequence JSON, VWP CSV or "
                       "storyrl JSONL records.", path="file")
    data_format: str = option("auto", "Format of data.", choices=DATA_FORMATS)
    image_root: str | None = option(None, "Directory that image ids and relative image paths are resolved in.",
                                    path="dir")
    limit: int | None = option(None, "Only the first N sequences of data.", min=1)
    setting: str = option("auto", "What the policy sees: text = the prompt only (auto: text).", choices=SETTINGS)
    prompt: str = option("P3", "Visual prompt name in the prompts file ({n} = the number of images).")
    prompts_file: str | None = option(None, "Prompt templates YAML (default: configs/prompts/dhm.yaml).", path="file")
    fill_count: bool = option(True, "Fill the sentence count in as a word; false sends the authors' 'N'.")

    # The RL path reads these; SFT has no images yet.
    freeze_vision_tower = True
    sequence_image_size = None
    sequence_image_dir = None

    def __post_init__(self) -> None:
        from storyrl.training.rl.config import LoraOptions

        if isinstance(self.lora, dict):
            self.lora = LoraOptions.from_mapping(self.lora)
        if not isinstance(self.lora, LoraOptions):
            raise ConfigTypeError(f"lora: expected a mapping of LoRA keys (enabled, r, ...), got {self.lora!r}")
        super_post = getattr(super(), "__post_init__", None)
        if super_post is not None:
            super_post()
        if self.load_in_4bit and not self.lora.enabled:
            raise ValueError("load_in_4bit: a 4-bit base trains through LoRA adapters only; set lora.enabled: true")

    # The RL config's own methods: same policy detection and prompts.
    def policy_kind(self, read_hub: bool = True) -> str | None:
        from storyrl.training.rl.config import RLConfig

        return RLConfig.policy_kind(self, read_hub)

    policy = "auto"

    def resolved_setting(self, kind: str) -> str:
        from storyrl.training.rl.config import RLConfig

        return RLConfig.resolved_setting(self, kind)

    def prompting_config(self) -> Any:
        from storyrl.training.rl.config import RLConfig

        return RLConfig.prompting_config(self)


@dataclass
class SFTResult:
    """What a run did: optimizer steps, the last logged loss, where the model is."""

    output_dir: str
    steps: int
    history: list[dict] = field(default_factory=list)

    @property
    def final_dir(self) -> str:
        return str(Path(self.output_dir) / "final")

    def summary(self) -> dict[str, Any]:  # what `storyrl train sft` prints
        losses = [e["loss"] for e in self.history if "loss" in e]
        return {"output_dir": self.output_dir, "final": self.final_dir, "steps": self.steps,
                "last_loss": losses[-1] if losses else None}


def sft_dataset(config: SFTRunConfig, kind: str, processing_class: Any):
    """Prompt/completion rows: RL's prompt of each sequence and its human story."""
    from storyrl.training.rl.data import build_dataset

    prompts = build_dataset(config, kind, processing_class)

    def row(example: dict) -> dict:
        story = (example["reference"] or "").strip()
        if not story:
            raise ValueError(f"{config.data}: story {example['story_id']!r} has no human story to train on")
        prompt = example["prompt"]
        if isinstance(prompt, str):  # plain text: the story continues the prompt after a space
            completion = story if not prompt or prompt[-1].isspace() else " " + story
        else:
            completion = [{"role": "assistant", "content": story}]
        return {"prompt": prompt, "completion": completion}

    return prompts.map(row, remove_columns=prompts.column_names)


def _sft_args(config: SFTRunConfig, progress: bool):
    import torch
    from trl import SFTConfig

    from storyrl.training.rl.policy import training_dtype

    cuda = torch.cuda.is_available()
    return SFTConfig(
        output_dir=config.output_dir, seed=config.seed, max_steps=config.max_steps or -1,
        num_train_epochs=config.epochs, learning_rate=config.learning_rate,
        per_device_train_batch_size=config.batch_size, gradient_accumulation_steps=config.gradient_accumulation_steps,
        max_length=config.max_length, logging_steps=config.logging_steps, save_steps=config.save_steps,
        report_to=config.report_to, disable_tqdm=not progress,
        completion_only_loss=True,  # the prompt is context, not something to learn
        use_cpu=not cuda, bf16=cuda and training_dtype(config.precision) == torch.bfloat16,
    )


def build_trainer(config: SFTRunConfig, progress: bool = True, callbacks: list | None = None):
    """TRL's SFTTrainer of ``config`` (policy, dataset, LoRA), not yet trained."""
    from trl import SFTTrainer

    from storyrl.training.rl.policy import load_policy, lora_config
    from storyrl.training.rl.trl_trainers import HistoryCallback

    kind = config.policy_kind()
    if kind != "causal_lm":
        raise ValueError(f"model {config.model}: a {kind} model; storyrl train sft fine-tunes causal LMs only "
                         "(VLM and TAPM support is not there yet)")
    policy = load_policy(config, kind)
    policy.tokenizer.padding_side = "right"  # training: the story ends where its tokens end
    dataset = sft_dataset(config, kind, policy.processing_class)
    trainer = SFTTrainer(model=policy.model, args=_sft_args(config, progress), train_dataset=dataset,
                         processing_class=policy.processing_class, peft_config=lora_config(config, kind),
                         callbacks=[HistoryCallback(config.output_dir), *(callbacks or [])])
    from transformers import PrinterCallback, ProgressCallback

    from storyrl.console import verbose
    from storyrl.training.rl.trl_trainers import QuietProgressCallback

    # stdout holds the command's JSON line only: RL's progress handling.
    if not progress:
        trainer.remove_callback(PrinterCallback)
    elif not verbose() and any([trainer.pop_callback(PrinterCallback), trainer.pop_callback(ProgressCallback)]):
        trainer.add_callback(QuietProgressCallback())
    return trainer


@guarded
def train(config: SFTRunConfig, resume: bool = False, progress: bool = True) -> SFTResult:
    """Fine-tune, then save the model and its tokenizer in ``OUTPUT_DIR/final``."""
    import logging

    from storyrl.training.rl.trl_trainers import latest_complete_checkpoint

    checkpoint = latest_complete_checkpoint(config.output_dir) if resume else None
    if resume and checkpoint is None:
        logging.getLogger(__name__).warning("resume: no complete checkpoint-<step>/ in %s; starting from the "
                                            "beginning", config.output_dir)
    trainer = build_trainer(config, progress)
    trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
    final = Path(config.output_dir) / "final"
    if config.lora.enabled and config.lora.merge:
        model = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        if trainer.is_world_process_zero():
            model.save_pretrained(final)
    else:
        trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        trainer.processing_class.padding_side = "left"  # what generation (and RL) wants
        trainer.processing_class.save_pretrained(final)
        config.to_yaml(final / "sft_config.yaml")
    return SFTResult(config.output_dir, trainer.state.global_step, list(trainer.state.log_history))


TRAINER = Trainer(
    SFTRunConfig, train,
    outputs="Checkpoints OUTPUT_DIR/checkpoint-<step>, one JSON line per log in OUTPUT_DIR/history.jsonl and the "
            "model in OUTPUT_DIR/final (a storyrl train rl --model).",
    resume_help="Continue from the latest complete OUTPUT_DIR/checkpoint-<step>.",
)
