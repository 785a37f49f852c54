"""GRPO and RLOO through TRL's trainers, with storyrl rewards and the story
monitor.

* The rewards are TRL reward functions as they are (``reward_weights`` and,
  for GRPO, ``multi_objective_aggregation`` come from the config); each is
  wrapped by :class:`StoryMonitor` so that every step also logs the story
  statistics of :func:`storyrl.training.storyteller.rl.monitor.story_stats` through
  TRL's ``log_metric`` (``story/...`` next to ``rewards/<name>/mean``, ``kl``,
  ...) and appends a few sample stories, with each reward's value and the
  weighted total, to ``OUTPUT_DIR/samples.jsonl``. The wrappers keep each
  reward's ``__name__`` (TRL's column name).
* ``processing_class`` is the tokenizer or, for a VLM, the processor; LoRA is
  TRL's ``peft_config`` (no reference copy: adapters disabled).
* Checkpoints are TRL's ``OUTPUT_DIR/checkpoint-<step>/``; ``resume``
  continues from the latest with ``resume_from_checkpoint`` (model,
  optimizer, scheduler, RNG and data position restored by transformers),
  and each epoch's prompt order is drawn from ``seed + epoch`` so that a
  resumed run reads the prompts in the same order as an uninterrupted one
  (TRL's sampler would replay the first epoch's order after a restart).
* Every log entry is also a line of ``OUTPUT_DIR/history.jsonl`` (rewritten
  from the restored state on resume, so it never holds an entry twice).
* The final policy goes to ``OUTPUT_DIR/final/`` with its tokenizer or
  processor: the LoRA adapters, or merged weights with ``lora.merge``.
* Sampling with transformers runs on the LoRA adapters merged into a copy of
  their weights (``merge_adapters_for_sampling``, default on;
  :mod:`storyrl.training.storyteller.rl.sampling`): peft's unmerged layers made TRL's
  generation phase ~1.3x ``generate`` on merged weights.
* :class:`RunGuard` (every storyrl TRL run has it: :class:`HistoryCallback`
  is one) stops a run whose loss or trainable weights turn NaN/inf before
  anything is saved, and makes a resume from a checkpoint that already
  holds every step train none (transformers would train one more when the
  run ended inside an epoch). ``--resume`` on a run that finished with the
  same config is a no-op (:func:`~storyrl.training.guards.finished_history`).

TAPM policies are refused (see :class:`~storyrl.training.storyteller.rl.config.RLConfig`):
both TRL trainers patch the forward of a ``PreTrainedModel`` driven by
``input_ids`` alone.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from storyrl.console import progress as progress_bar
from storyrl.console import verbose
from storyrl.training.storyteller.rl.monitor import finite_or_none, sample_stories, story_stats
from storyrl.training.storyteller.rl.trl_guards import (  # noqa: F401  (re-exported: where trainers import them from)
    RunGuard,
    TrainingDone,
    latest_complete_checkpoint,
    resume_checkpoint,
    run_training,
)

__all__ = ["HISTORY", "SAMPLES", "AsyncMonitoredReward", "FinishedRun", "HistoryCallback", "MonitoredReward",
           "RunGuard", "ScorableCheck", "StoryMonitor", "TrainingDone", "latest_complete_checkpoint",
           "load_full_weights", "quiet_progress", "resume_checkpoint", "run_training", "save_final",
           "train_to_final", "train_trl"]

logger = logging.getLogger(__name__)

HISTORY = "history.jsonl"
SAMPLES = "samples.jsonl"


class StoryMonitor:
    """Logs the signs of reward hacking from inside the reward calls of one
    step: the first reward to report logs the story statistics through
    ``log_metric``; the last one writes ``num_samples`` sample stories with
    every reward's value and the weighted total (None when no weighted reward
    scored it) to ``samples_path`` (main process only)."""

    def __init__(self, weights: Sequence[float], samples_path: str | Path | None, num_samples: int = 3,
                 is_main: bool = True) -> None:
        self.weights = list(weights)
        self.samples_path = Path(samples_path) if samples_path is not None else None
        self.num_samples = num_samples
        self.is_main = is_main
        self._texts: list[str | None] = []
        self._values: dict[int, list] = {}
        self.names: list[str] = []

    def wrap(self, rewards: Sequence[Any]) -> list[MonitoredReward]:
        if len(rewards) != len(self.weights):
            raise ValueError(f"{len(self.weights)} reward weights for {len(rewards)} rewards")
        from storyrl.rewards.concurrent import is_async_reward

        # An async reward keeps an async wrapper: TRL awaits it with the other async ones.
        wrapped = [(AsyncMonitoredReward if is_async_reward(r) else MonitoredReward)(r, i, self)
                   for i, r in enumerate(rewards)]
        self.names = [w.__name__ for w in wrapped]
        return wrapped

    def record(self, index: int, completions: Sequence[Any], values: Sequence[float | None],
               kwargs: dict[str, Any]) -> None:
        from storyrl.rewards import completion_text

        # TRL calls the sync rewards in order, then the async ones together, so
        # any reward may report first: a step starts with the first report, and
        # a reward reporting twice means the last step did not finish.
        if index in self._values:
            self._values = {}
        if not self._values:
            self._texts = [completion_text(c) for c in completions]
            self._values = {}
            ids = kwargs.get("completion_ids")
            lengths = [len(i) for i in ids] if ids is not None else None
            log_metric = kwargs.get("log_metric")
            if callable(log_metric):
                for name, value in story_stats(self._texts, lengths).items():
                    if math.isfinite(value):  # distinct-n of a batch without n-grams is NaN
                        log_metric(name, value)
        self._values[index] = list(values)
        if len(self._values) == len(self.weights):
            self._write_samples(kwargs.get("trainer_state"))

    def totals(self) -> list[float | None]:
        """The weighted sum per story, as TRL forms it (None rewards left out;
        None when every weighted reward is None)."""
        out = []
        for k in range(len(self._texts)):
            terms = [(w, self._values[i][k]) for i, w in enumerate(self.weights) if i in self._values]
            scored = [w * v for w, v in terms if v is not None]
            out.append(sum(scored) if scored else None)
        return out

    def _write_samples(self, state: Any) -> None:
        if not self.is_main or self.num_samples == 0:
            return
        totals = self.totals()
        samples = sample_stories(self._texts, [math.nan if t is None else t for t in totals], self.num_samples)
        for k, sample in enumerate(samples):
            sample["rewards"] = {name: finite_or_none(self._values[i][k]) for i, name in enumerate(self.names)}
        # The optimisation step these completions feed (history.jsonl's "step").
        step = state.global_step + 1 if state is not None else None
        if samples:
            logger.info("step %s: sample story (reward %s): %s", step, samples[0]["reward"], samples[0]["story"][:300])
        if self.samples_path is not None:
            self.samples_path.parent.mkdir(parents=True, exist_ok=True)
            with self.samples_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "samples": samples}, ensure_ascii=False) + "\n")


class MonitoredReward:
    """A reward function that reports its values to the :class:`StoryMonitor`;
    TRL sees the wrapped reward's ``__name__``."""

    def __init__(self, reward: Any, index: int, monitor: StoryMonitor) -> None:
        self.reward, self.index, self.monitor = reward, index, monitor
        self.__name__ = getattr(reward, "__name__", type(reward).__name__)

    def __call__(self, prompts=None, completions=None, **kwargs: Any) -> list[float | None]:
        values = self.reward(prompts=prompts, completions=completions, **kwargs)
        self.monitor.record(self.index, completions, values, kwargs)
        return values


class AsyncMonitoredReward(MonitoredReward):
    """:class:`MonitoredReward` of an async reward function (TRL runs it
    concurrently with its other async rewards)."""

    async def __call__(self, prompts=None, completions=None, **kwargs: Any) -> list[float | None]:
        values = await self.reward(prompts=prompts, completions=completions, **kwargs)
        self.monitor.record(self.index, completions, values, kwargs)
        return values


class HistoryCallback(RunGuard):
    """``history.jsonl``: one line per log entry (main process); on (re)start
    it is rewritten from the trainer's restored log history and
    ``samples.jsonl`` is cut back to the checkpoint's steps. Every storyrl
    TRL trainer adds it, so it is also the run's :class:`RunGuard`."""

    def __init__(self, output_dir: str | Path) -> None:
        self.history = Path(output_dir) / HISTORY
        self.samples = Path(output_dir) / SAMPLES

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if not state.is_world_process_zero:
            return
        self.history.parent.mkdir(parents=True, exist_ok=True)
        self.history.write_text("".join(_line(entry) for entry in state.log_history), encoding="utf-8")
        if self.samples.exists():
            kept = [line for line in self.samples.read_text(encoding="utf-8").splitlines()
                    if line.strip() and (json.loads(line).get("step") or 0) <= state.global_step]
            self.samples.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        if state.is_world_process_zero and logs is not None:
            with self.history.open("a", encoding="utf-8") as f:
                f.write(_line({**logs, "step": state.global_step}))


class QuietProgressCallback(TrainerCallback):
    """transformers' training bar without the ~40-key dict its ProgressCallback
    prints at every logged step (history.jsonl keeps them all): the bar shows
    the loss and the mean reward instead, and stays plain in a log
    (:func:`storyrl.console.progress`). ``--verbose`` keeps transformers' own."""

    def __init__(self) -> None:
        self.bar = None
        self.current_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.bar = progress_bar(total=state.max_steps, unit="step")
        self.current_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.current_step)
            self.current_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is None or not logs:
            return
        short = {key: f"{logs[key]:.4g}" for key in ("loss", "reward")
                 if isinstance(logs.get(key), (int, float)) and not isinstance(logs.get(key), bool)}
        if short:
            self.bar.set_postfix(short, refresh=False)  # shown at the next update (throttled in a log)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _line(entry: dict) -> str:
    return json.dumps({k: finite_or_none(v) for k, v in entry.items()}, ensure_ascii=False) + "\n"


def train_trl(config, policy, dataset, rewards: Sequence[Any], resume: bool = False, progress: bool = True,
              callbacks: Sequence[Any] | None = None) -> Any:
    """Run TRL's GRPOTrainer or RLOOTrainer for ``config.algorithm``; returns
    the trainer after saving ``final/``. A run that trained no step, or
    whose rewards scored no story at its first logged steps, fails
    (:class:`~storyrl.training.runs.RunFailedError`) without ``final/``."""
    from trl import GRPOTrainer, RLOOTrainer

    from storyrl.training.storyteller.rl.policy import lora_config, trl_reference
    from storyrl.training.runs import RunFailedError

    if policy.kind == "tapm":
        raise ValueError(f"algorithm {config.algorithm}: a TAPM policy trains with ppo only")
    args = config.algorithm_config()
    if not progress:
        args.disable_tqdm = True
    output_dir = Path(config.output_dir)
    checkpoint = resume_checkpoint(output_dir, resume, config.max_steps)
    weights = list(config.reward_weights) if config.reward_weights is not None else [1.0] * len(rewards)
    is_main = args.process_index == 0
    monitor = StoryMonitor(weights, output_dir / SAMPLES, is_main=is_main)
    if checkpoint is None and is_main and (output_dir / SAMPLES).exists():
        (output_dir / SAMPLES).unlink()  # a fresh run's samples only
    if args.use_vllm and args.vllm_mode == "colocate" and args.world_size % args.vllm_tensor_parallel_size:
        raise ValueError(f"{config.algorithm}.vllm_tensor_parallel_size {args.vllm_tensor_parallel_size} does not "
                         f"divide the {args.world_size} training process(es): each vLLM engine spans that many")
    if len(dataset) < args.generation_batch_size // args.num_generations:
        # TRL's sampler drops an incomplete round: the run would train nothing (or fail obscurely).
        raise RunFailedError(_no_step(config.algorithm, args, len(dataset)))
    wrapped = monitor.wrap(rewards)
    scorable = ScorableCheck([w.__name__ for w in wrapped], weights)
    trainer_class = _resumable(_merged_sampling(GRPOTrainer if config.algorithm == "grpo" else RLOOTrainer,
                                                config.merge_adapters_for_sampling))
    with trl_reference(config, policy.kind, trainer_class):
        trainer = trainer_class(
            model=policy.model,
            reward_funcs=wrapped,
            args=args,
            train_dataset=dataset,
            processing_class=policy.processing_class,
            peft_config=lora_config(config, policy.kind),
            callbacks=[HistoryCallback(output_dir), scorable, *(callbacks or [])],
        )
    quiet_progress(trainer, progress)
    run_training(trainer, checkpoint)
    if scorable.failure is not None:
        raise RunFailedError(scorable.failure)
    if trainer.state.global_step == 0:
        raise RunFailedError(_no_step(config.algorithm, args, len(dataset)))
    save_final(config, trainer, output_dir / "final")
    return trainer


def _no_step(algorithm: str, args, prompts: int) -> str:
    per_round = args.generation_batch_size // args.num_generations
    return (f"{algorithm}: trained 0 steps: {prompts} prompts do not fill one generation round of {per_round} "
            f"({args.world_size} process(es) x per_device_train_batch_size {args.per_device_train_batch_size} x "
            f"steps_per_generation {args.steps_per_generation} completions, {args.num_generations} per prompt); "
            "use more prompts, fewer processes or smaller batches")


class ScorableCheck(TrainerCallback):
    """Stops a run whose rewards score no story: at a logged step where every
    reward with a non-zero weight has no value (TRL logs a NaN mean), before
    any step scored a story, training stops and :attr:`failure` says why.
    TRL logs the means gathered over processes, so every process agrees."""

    def __init__(self, names: Sequence[str], weights: Sequence[float]) -> None:
        self.names = [n for n, w in zip(names, weights) if w != 0]
        self.failure: str | None = None
        self.scored = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.scored = any(self._scored(entry) for entry in state.log_history)  # a resumed run's earlier steps

    def _scored(self, logs: dict) -> bool:
        means = [logs.get(f"rewards/{name}/mean") for name in self.names]
        return any(isinstance(m, (int, float)) and math.isfinite(m) for m in means)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not any(f"rewards/{name}/mean" in logs for name in self.names):
            return
        if self._scored(logs):
            self.scored = True
        elif not self.scored:
            self.failure = (f"step {state.global_step}: no story was scorable: {', '.join(self.names)} returned "
                            "None/NaN for every completion (nothing to learn from); check what the rewards need "
                            "(references, images, models) in samples.jsonl and history.jsonl")
            control.should_training_stop = True
        else:
            logger.warning("step %d: no story was scorable by %s", state.global_step, ", ".join(self.names))


def _merged_sampling(trainer_class: type, enabled: bool) -> type:
    """``trainer_class`` whose transformers ``generate`` samples on merged
    LoRA weights (:func:`storyrl.training.storyteller.rl.sampling.merged_adapters`;
    TRL samples through peft's unmerged layers). vLLM has its own copy of
    the weights; TRL's sync to it, which merges the adapters in place and
    back, runs on copies of the base weights
    (:func:`~storyrl.training.storyteller.rl.sampling.kept_base_weights`)."""
    from storyrl.training.storyteller.rl.sampling import kept_base_weights, merged_adapters

    class MergedSampling(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.use_vllm:  # TRL merges LoRA into the base and back in place to push it to vLLM: kept exact
                model, sync = self.accelerator.unwrap_model(self.model), self.vllm_generation.sync_weights

                def exact_sync():
                    with kept_base_weights(model):
                        return sync()

                self.vllm_generation.sync_weights = exact_sync

        def _generate_single_turn(self, *args, **kwargs):
            on = enabled and not self.use_vllm
            with merged_adapters(self.accelerator.unwrap_model(self.model), on):
                return super()._generate_single_turn(*args, **kwargs)

    MergedSampling.__name__ = MergedSampling.__qualname__ = trainer_class.__name__
    return MergedSampling


def _resumable(trainer_class: type) -> type:
    """``trainer_class`` whose prompt order survives a restart.

    TRL's ``RepeatSampler`` draws each epoch's permutation from one generator
    seeded once, so a run resumed in epoch k >= 1 replays epoch 0's order (a
    fresh generator; transformers' ``set_epoch`` does not reach it). Here the
    permutation of epoch k is drawn from ``seed + k``, k read from the
    trainer's state (restored from the checkpoint, fractional mid-epoch), so a
    resumed run reads the prompts in the uninterrupted run's order."""
    from trl.trainer.utils import RepeatSampler

    class EpochSeededSampler(RepeatSampler):
        def __init__(self, sampler: RepeatSampler, epoch_of) -> None:
            super().__init__(sampler.data_source, sampler.mini_repeat_count, sampler.batch_size,
                             sampler.repeat_count, sampler.shuffle, sampler.seed)
            self.epoch_of = epoch_of

        def __iter__(self):
            if self.shuffle:
                self.generator.manual_seed((self.seed or 0) + self.epoch_of())
            return super().__iter__()

    class Resumable(trainer_class):
        def _get_train_sampler(self, dataset=None):
            sampler = super()._get_train_sampler(dataset)
            if not isinstance(sampler, RepeatSampler):
                return sampler
            return EpochSeededSampler(sampler, lambda: math.floor((self.state.epoch or 0) + 1e-9))

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            if not load_full_weights(self.accelerator.unwrap_model(self.model if model is None else model),
                                     Path(resume_from_checkpoint)):
                super()._load_from_checkpoint(resume_from_checkpoint, model)

    Resumable.__name__ = Resumable.__qualname__ = trainer_class.__name__
    return Resumable


def load_full_weights(model, checkpoint: Path) -> bool:
    """Load a full-weight checkpoint into ``model`` the way ``from_pretrained``
    reads it; False (nothing done) for adapters or a checkpoint without full
    weights.

    transformers saves some models (LLaVA-NeXT among them) with the hub's key
    names and maps them back only in ``from_pretrained``; the Trainer's resume
    loads the file's keys as they are, so every weight came up "missing" and
    the run went on from the initial weights. Every key must match here."""
    from transformers import PreTrainedModel
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    if not isinstance(model, PreTrainedModel) or not any(
            (checkpoint / name).is_file() for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
                                                       WEIGHTS_INDEX_NAME)):
        return False
    dtype = next(model.parameters()).dtype
    saved = type(model).from_pretrained(checkpoint, dtype=dtype)
    result = model.load_state_dict(saved.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        problems = result.missing_keys[:3] or result.unexpected_keys[:3]
        raise ValueError(f"{checkpoint}: its weights do not fit the policy ({', '.join(problems)} ...); it was "
                         "written by another model")
    logger.info("resume: policy weights loaded from %s", checkpoint)
    return True


def save_final(config, trainer, final: Path, config_file: str = "rl_config.yaml") -> None:
    """The trained policy in ``final``: adapters (or merged weights with
    ``lora.merge``) or full weights, with the tokenizer/processor (left
    padding: what generation and RL want), the run's config as
    ``config_file`` and storyrl's model card (:mod:`storyrl.training.model_card`)."""
    from storyrl.training.model_card import write_model_card

    if config.lora.enabled and config.lora.merge:
        model = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        if trainer.is_world_process_zero():
            model.save_pretrained(final)
    else:
        trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        tokenizer.padding_side = "left"  # SFT and DPO train right-padded
        trainer.processing_class.save_pretrained(final)
        config.to_yaml(final / config_file)
        write_model_card(final, config, config_file.removesuffix("_config.yaml"), steps=trainer.state.global_step)


class FinishedRun:
    """What :func:`train_to_final` returns for a run that had finished: its
    ``state`` (``global_step``, ``log_history``) as a trainer's."""

    def __init__(self, history: list[dict]) -> None:
        from types import SimpleNamespace

        self.state = SimpleNamespace(global_step=history[-1]["step"], log_history=history)


def train_to_final(config, build_trainer, resume: bool, progress: bool, config_file: str):
    """A storyteller run of a TRL trainer (SFT, DPO): find the checkpoint to
    resume from (before building: an incomplete one is removed), build the
    trainer with ``build_trainer(config, progress)``, train, save
    ``OUTPUT_DIR/final`` (:func:`save_final`). Returns the trainer, or for
    a resumed run that had finished with this config a :class:`FinishedRun`
    (nothing is built, trained or written)."""
    from storyrl.training.guards import finished_history

    checkpoint = resume_checkpoint(config.output_dir, resume, config.max_steps)
    history = finished_history(config, config_file) if resume else None
    if history is not None:
        logger.info("resume: %s/final holds this run, finished at step %d; nothing to do", config.output_dir,
                    history[-1]["step"])
        return FinishedRun(history)
    trainer = build_trainer(config, progress)
    if hasattr(config, "max_length") and len(trainer.train_dataset) == 0:
        raise ValueError(f"max_length {config.max_length}: no training example is left once TRL's preprocessing "
                         "cut prompt + story to max_length (every prompt fills it); raise max_length")
    run_training(trainer, checkpoint)
    save_final(config, trainer, Path(config.output_dir) / "final", config_file=config_file)
    return trainer


def quiet_progress(trainer, progress: bool) -> None:
    """stdout holds the command's JSON line only: without ``progress`` no
    per-log printing; without ``--verbose`` transformers' printer/progress
    bar becomes one quiet bar. Printer: what transformers uses when its
    logging level (error without --verbose) made TrainingArguments default
    to disable_tqdm. A notebook's widget is neither and stays."""
    from transformers import PrinterCallback, ProgressCallback

    from storyrl.training.model_card import library_cards_callback

    trainer.add_callback(library_cards_callback())  # TRL's and PEFT's checkpoint cards (storyrl's is in final/)
    if not progress:
        trainer.remove_callback(PrinterCallback)  # what transformers prints each log with disable_tqdm
    elif not verbose() and any([trainer.pop_callback(PrinterCallback), trainer.pop_callback(ProgressCallback)]):
        trainer.add_callback(QuietProgressCallback())
