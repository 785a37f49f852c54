"""What every storyteller trainer shares (``storyrl train rl``, ``sft``,
``dpo``): the policy's options, the image sequences and their prompts, and
the result of a run.

:class:`StorytellerConfig` holds the options a storyteller run reads the way
``storyrl train rl`` reads them -- the policy (model, precision, 4-bit,
LoRA) and the data and prompts (the generators' prompt templates, sequence
images) -- so that SFT, DPO and RL train on the same prompt ``storyrl
generate`` sends. Each trainer's config subclasses it and adds its own keys.
This module imports no torch or TRL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storyrl.config import Config, option
from storyrl.datasets import DATA_FORMATS
from storyrl.models.runtime import PRECISIONS
from storyrl.models.vlm import DEFAULT_VLM

__all__ = ["POLICIES", "SETTINGS", "LoraOptions", "RunResult", "StorytellerConfig", "TrlRunOptions", "match_precision"]

POLICIES = ("auto", "causal_lm", "vlm", "tapm")
#: How the policy sees the image sequence (see StorytellerConfig.setting).
SETTINGS = ("auto", "visual", "separate", "text")


@dataclass
class LoraOptions(Config):
    """LoRA adapters (peft ``LoraConfig``) instead of training every weight."""

    _field_word = "key"

    enabled: bool = option(False, "Train LoRA adapters; the base stays frozen and, with adapters disabled, is the "
                           "KL reference (no second copy).")
    r: int = option(16, "Adapter rank.", min=1)
    alpha: int = option(32, "LoRA alpha (scale = alpha / r).", min=1)
    dropout: float = option(0.05, "Dropout on the adapters' input.", min=0.0, max=1.0)
    target_modules: list[str] | str = option(factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                             help="Module names that get adapters, or 'all-linear'.")
    merge: bool = option(False, "Save final/ as merged full weights instead of the adapters (not with 4-bit).")


@dataclass(kw_only=True)
class StorytellerConfig(Config):
    """The policy, data and prompt options of a storyteller run (module docs)."""

    _field_word = "key"

    # -- policy -------------------------------------------------------------------
    model: str = option(DEFAULT_VLM, "Policy: hub name or local directory of a causal LM, an image-text-to-text "
                        "model or a trained TAPM directory.")
    policy: str = option("auto", "Policy kind; auto reads the model's config (TAPM directory -> tapm, "
                         "image-text-to-text -> vlm, else causal_lm).", choices=POLICIES)
    revision: str | None = option(None, "Hub revision of the model (branch, tag or commit).")
    precision: str = option("auto", "Weights dtype: auto = bf16 on a CUDA GPU that supports it, else fp32.",
                            choices=PRECISIONS)
    load_in_4bit: bool = option(False, "Load the base model in 4 bit (bitsandbytes NF4, CUDA); needs LoRA.")
    lora: LoraOptions = option(factory=LoraOptions, help="LoRA adapters: enabled, r, alpha, dropout, "
                               "target_modules, merge.", cli=False)
    freeze_vision_tower: bool = option(True, "VLM policies: the vision encoder does not train (nor gets adapters).")
    # -- data and prompts -----------------------------------------------------------
    data: str = option(help="Image sequences with their human stories: VIST story-in-sequence JSON, VWP CSV or "
                       "storyrl JSONL records.", path="file")
    data_format: str = option("auto", "Format of data.", choices=DATA_FORMATS)
    image_root: str | None = option(None, "Directory that image ids and relative image paths are resolved in.",
                                    path="dir")
    limit: int | None = option(None, "Only the first N sequences of data.", min=1)
    setting: str = option("auto", "What the policy sees: visual = the sequence as one image (the generators' "
                          "visual setting), separate = each image, text = the prompt only; auto = visual for "
                          "VLMs, text otherwise.", choices=SETTINGS)
    prompt: str = option("P3", "Visual prompt name in the prompts file ({n} = the number of images).")
    prompts_file: str | None = option(None, "Prompt templates YAML (default: configs/prompts/dhm.yaml).", path="file")
    fill_count: bool = option(True, "Fill the sentence count in as a word; false sends the authors' 'N'.")
    sequence_image_size: str | None = option(None, "Resize each image to WIDTHxHEIGHT in the sequence image.")
    sequence_image_dir: str | None = option(None, "Ready sequence images <story_id>.png or seq_<story_id>.png.",
                                            path="dir")

    def _problems(self) -> list[str]:
        problems = []
        if not Path(self.data).is_file():
            problems.append(f"data: no such file {self.data}")
        if self.load_in_4bit and not self.lora.enabled:
            problems.append("load_in_4bit: a 4-bit base trains through LoRA adapters only; set lora.enabled: true")
        if self.load_in_4bit and self.lora.merge:
            problems.append("lora.merge: adapters are not merged into a 4-bit base; save them (merge: false)")
        try:
            self.prompting_config().template()
        except (TypeError, ValueError) as exc:
            problems.append(str(exc).replace("PromptingConfig: ", ""))
        # Telling a local model's kind imports transformers (seconds): only where it matters.
        kind = self.policy_kind(read_hub=False) if self.setting in ("visual", "separate") else None
        if kind in ("causal_lm", "tapm"):
            problems.append(f"setting {self.setting}: a {kind} policy sees no images; use setting text (or auto)")
        return problems

    def policy_kind(self, read_hub: bool = True) -> str | None:
        """``causal_lm``, ``vlm`` or ``tapm``: ``policy`` unless auto, else read
        from the model's config (a hub model only with ``read_hub``; None if
        it cannot be told)."""
        if self.policy != "auto":
            return self.policy
        from storyrl.training.storyteller.rl.policy import detect_policy

        return detect_policy(self.model, self.revision, read_hub=read_hub)

    def resolved_setting(self, kind: str) -> str:
        """The setting for a policy of ``kind``: auto = visual for VLMs, text otherwise."""
        if self.setting != "auto":
            return self.setting
        return "visual" if kind == "vlm" else "text"

    def prompting_config(self) -> Any:
        """The generators' prompting options for the prompts (templates, sequence images)."""
        from storyrl.generators.prompting import PromptingConfig

        return PromptingConfig(model=self.model, setting="visual", prompt=self.prompt,
                               prompts_file=self.prompts_file, fill_count=self.fill_count,
                               image_root=self.image_root, sequence_image_size=self.sequence_image_size,
                               sequence_image_dir=self.sequence_image_dir)


@dataclass(kw_only=True)
class TrlRunOptions(Config):
    """The run keys of a storyrl trainer wrapping a TRL trainer (SFT, DPO,
    the reward model): where it writes, how long it trains, how it logs.
    :meth:`trl_arguments` gives them as TRL config arguments. Subclasses
    redeclare a key to change its default or help."""

    _field_word = "key"

    output_dir: str = option(help="TRL's checkpoint-<step>/, history.jsonl and the model in final/.", path="new-dir")
    seed: int = option(0, "Seed of the run (data order, adapter initialisation).")
    max_steps: int | None = option(None, "Optimizer steps; default: epochs over the data.", min=1)
    epochs: float = option(1.0, "Passes over the data (when max_steps is not set).", min=0.0)
    learning_rate: float = option(2e-5, "AdamW learning rate.", min=0.0)
    batch_size: int = option(8, "Examples per device and step.", min=1)
    gradient_accumulation_steps: int = option(1, "Batches per optimizer step.", min=1)
    max_length: int = option(1024, "Tokens of prompt + story; longer ones lose their end.", min=1)
    logging_steps: int = option(10, "Log (and write history.jsonl) every N steps.", min=1)
    save_steps: int = option(500, "Write checkpoint-<step>/ every N steps.", min=1)
    report_to: str | list[str] = option("none", "Trackers: tensorboard, wandb, ... (a name or a list), all or none.")

    def _problems(self) -> list[str]:
        from storyrl.training.storyteller.rl.ppo.config import tracker_problems

        problems = tracker_problems(self.report_to)
        lora = getattr(self, "lora", None)
        if getattr(self, "precision", None) == "fp16" and not (lora is not None and lora.enabled):
            # fp16=True's GradScaler refuses fp16 gradients, and without it Adam's
            # updates (and its eps) underflow in fp16 weights: nothing trains them right.
            problems.append("precision: fp16 weights have no fp32 master copy to train; use bf16 or fp32, or "
                            "train fp32 LoRA adapters on the fp16 base (lora.enabled: true)")
        return super()._problems() + problems

    def trl_arguments(self, progress: bool) -> dict[str, Any]:
        """These keys as TRL config arguments (TrainingArguments names), on
        the CPU without CUDA. The weights' ``precision`` (of the subclass)
        sets TRL's autocast: bf16 weights run under bf16 autocast, an fp16
        base under fp16 autocast with loss scaling (its fp32 LoRA adapters
        are what trains), on the CPU as on a GPU (:func:`match_precision`)."""
        import torch

        from storyrl.training.storyteller.rl.policy import training_dtype

        dtype = training_dtype(getattr(self, "precision", "fp32"))
        return dict(
            output_dir=self.output_dir, seed=self.seed, max_steps=self.max_steps or -1,
            num_train_epochs=self.epochs, learning_rate=self.learning_rate,
            per_device_train_batch_size=self.batch_size, gradient_accumulation_steps=self.gradient_accumulation_steps,
            max_length=self.max_length, logging_steps=self.logging_steps, save_steps=self.save_steps,
            report_to=self.report_to, disable_tqdm=not progress,
            use_cpu=not torch.cuda.is_available(), bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)


def match_precision(trainer: Any) -> Any:
    """``trainer`` (a transformers/TRL Trainer, not yet trained) with the
    fp16 autocast and GradScaler its ``fp16=True`` asks for on the CPU too,
    where accelerate makes neither and would train in whatever dtype the
    weights have (:func:`storyrl.training.accelerators.cpu_fp16`)."""
    if trainer.args.fp16 and trainer.accelerator.scaler is None and trainer.accelerator.device.type == "cpu":
        from storyrl.training.accelerators import cpu_fp16

        cpu_fp16(trainer.accelerator)
    return trainer


@dataclass(kw_only=True)
class RunResult:
    """What a storyteller run did: optimisation steps done in total, the log
    history (one dict per logged step) and where the model is (``final/``)."""

    output_dir: str
    steps: int
    history: list[dict] = field(default_factory=list)

    @property
    def final_dir(self) -> str:
        return str(Path(self.output_dir) / "final")

    def summary(self) -> dict[str, Any]:
        """The command's JSON line (``storyrl train <name>`` prints it)."""
        return {"output_dir": self.output_dir, "final": self.final_dir, "steps": self.steps}


_PROBE = "storyrl-turn-probe"


def turn_end(processing_class: Any) -> str:
    """What a story completion must end with so the policy learns to stop:
    the tokenizer's EOS when its chat template closes an assistant turn with
    nothing that holds it (TRL appends EOS to plain-text completions only,
    and leaves a conversation's ending to the template), else "". A
    template that cannot render the probe is trusted."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    eos = getattr(tokenizer, "eos_token", None)
    if not eos:
        return ""
    conversation = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = processing_class.apply_chat_template(conversation, tokenize=False)
    except Exception:  # noqa: BLE001  (any template error: leave the ending to the template)
        return ""
    if not isinstance(text, str) or _PROBE not in text:
        return ""
    return "" if eos in text.rsplit(_PROBE, 1)[1] else eos


def story_completion(prompt: Any, story: str, end: str = "") -> Any:
    """``story`` as the completion of ``prompt`` (TRL's prompt/completion
    format): an assistant turn of a conversation, ``end``
    (:func:`turn_end`) appended, else the text after a space."""
    story = story.strip()
    if isinstance(prompt, list):
        return [{"role": "assistant", "content": story + end}]
    return story if not prompt or prompt[-1].isspace() else " " + story
