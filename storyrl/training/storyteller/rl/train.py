"""``storyrl train rl``: one RL run from an :class:`RLConfig`.

:func:`train` loads the policy (:mod:`storyrl.training.storyteller.rl.policy`), builds
the prompt dataset (:mod:`storyrl.training.storyteller.rl.data`) and the rewards (their
models load before training starts, so a broken reward fails at once), does the
rewards' image side once over the dataset (``prepare_rewards``), saves
the resolved config as ``OUTPUT_DIR/rl_config.yaml`` and runs the algorithm:
``grpo``/``rloo`` through TRL (:mod:`storyrl.training.storyteller.rl.trl_trainers`),
``ppo`` through storyrl's :class:`~storyrl.training.storyteller.rl.ppo.PPOTrainer`. The
trained policy lands in ``OUTPUT_DIR/final/``.

``resume`` continues from the latest checkpoint in ``OUTPUT_DIR`` (a run
without one starts from the beginning, with a warning), with the same state
as an uninterrupted run. On a run whose ``final/`` was written with the same
config it is a no-op: nothing is loaded or written, the summary is the
run's (:func:`~storyrl.training.guards.finished_history`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyrl.training import Trainer
from storyrl.training.storyteller.rl.config import ALGORITHMS, RLConfig
from storyrl.training.runs import guarded, is_main_process
from storyrl.training.storyteller.config import RunResult

__all__ = ["CONFIG_FILE", "TRAINER", "RLResult", "prepare_rewards", "run_ppo", "run_trl", "train"]

logger = logging.getLogger(__name__)

CONFIG_FILE = "rl_config.yaml"


@dataclass(kw_only=True)
class RLResult(RunResult):
    """What a run did (:class:`~storyrl.training.storyteller.config.RunResult`) with
    which algorithm."""

    algorithm: str

    def summary(self) -> dict[str, Any]:
        """The command's JSON line: directories, steps and the last logged reward."""
        from storyrl.training.storyteller.rl.monitor import last_reward

        return {"algorithm": self.algorithm, "output_dir": self.output_dir, "final": self.final_dir,
                "steps": self.steps, "last_reward": last_reward(self.history)}


def _save_config(config: RLConfig, resume: bool) -> None:
    # Rank from the launcher, not accelerate: state created here would fix
    # the process count before the trainer's own accelerator (runs.process_state).
    if not is_main_process():
        return
    path = Path(config.output_dir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if resume and path.is_file():
        try:
            before = RLConfig.from_yaml(path).to_dict()
        except (TypeError, ValueError) as exc:
            logger.warning("%s: cannot read the saved config (%s); it is replaced", path, exc)
        else:
            changed = sorted(k for k, v in config.to_dict().items() if before.get(k) != v and k != "max_steps")
            if changed:
                logger.warning("resume: the config differs from the saved one in %s", ", ".join(changed))
    config.to_yaml(path)


@guarded
def train(config: RLConfig, resume: bool = False, progress: bool = True, callbacks: list | None = None) -> RLResult:
    """Run the RL fine-tuning of ``config`` (module docs). ``callbacks`` are
    extra transformers ``TrainerCallback`` objects for the TRL trainers
    (storyrl's PPO refuses them: it has no TrainerState to call them with);
    ``overwrite=True`` (keyword) replaces an earlier run in ``output_dir``
    (:func:`storyrl.training.runs.run_directory`)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()  # weight loading and saving too
    try:
        return _train(config, resume, progress, callbacks)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _train(config: RLConfig, resume: bool, progress: bool, callbacks: list | None) -> RLResult:
    from storyrl.training.storyteller.rl.data import build_dataset
    from storyrl.training.storyteller.rl.policy import load_policy

    algorithm = ALGORITHMS[config.algorithm]
    if callbacks and not algorithm.callbacks:
        raise ValueError(f"algorithm {config.algorithm}: callbacks (transformers TrainerCallback objects) are for "
                         f"{', '.join(n for n, a in ALGORITHMS.items() if a.callbacks)}; storyrl's "
                         f"{config.algorithm} takes none: leave callbacks unset")
    history = _finished(config) if resume else None
    if history is not None:
        return RLResult(algorithm=config.algorithm, output_dir=config.output_dir, steps=history[-1]["step"],
                        history=history)
    kind = config.policy_kind()
    if kind == "tapm" and config.algorithm != "ppo":
        raise ValueError(f"algorithm {config.algorithm}: a TAPM policy trains with ppo only")
    from storyrl.models.pretrained import check_weight_files

    check_weight_files(config.model)  # before the rewards load: a corrupted model file is named at once
    from storyrl.rewards.base import FatalRewardError, RewardError

    rewards = config.build_rewards()
    for reward in rewards:
        try:
            reward.setup()  # a reward that cannot load fails now, not after the first rollout
        except RewardError as exc:
            raise ValueError(str(exc)) from exc
    reward_functions = config.reward_functions(rewards)
    policy = load_policy(config, kind)
    dataset = build_dataset(config, kind, policy.processing_class)
    prepare_rewards(config, rewards, dataset, progress)
    rewards = reward_functions
    _save_config(config, resume)
    try:
        return algorithm.runner()(config, policy, dataset, rewards, resume=resume, progress=progress,
                                  callbacks=callbacks)
    except FatalRewardError as exc:
        # A reward server down for good, a rejected token: one line, no final/.
        from storyrl.training.runs import RunFailedError

        raise RunFailedError(f"stopped: {exc}") from exc


def _finished(config: RLConfig) -> list[dict] | None:
    """The history of a run that finished with this config (its latest
    checkpoint checked first: one past max_steps or named for another step
    is refused even then), else None."""
    from storyrl.training.guards import check_named_checkpoint, finished_history

    if config.algorithm == "ppo":
        from storyrl.training.storyteller.rl.ppo import find_latest_checkpoint

        checkpoint = find_latest_checkpoint(config.output_dir)
        if checkpoint is not None:
            check_named_checkpoint(checkpoint, "step", config.max_steps)
    else:
        from storyrl.training.storyteller.rl.trl_guards import latest_complete_checkpoint

        checkpoint = latest_complete_checkpoint(config.output_dir)
        if checkpoint is not None:
            check_named_checkpoint(checkpoint, "global_step", config.max_steps)
    history = finished_history(config, CONFIG_FILE)
    if history is not None:
        logger.info("resume: %s/final holds this run, finished at step %d; nothing to do", config.output_dir,
                    history[-1]["step"])
    return history


#: Dataset columns that :meth:`~storyrl.rewards.base.Reward.prepare` reads
#: (``story_images``: the per-position image paths, the rewards' ``images``).
PREPARE_COLUMNS = ("story_images", "image_ids", "reference", "story_id")


def prepare_rewards(config: RLConfig, rewards: list, dataset, progress: bool = True) -> dict | None:
    """Every reward's image side (and d_HM's human stories) done once over
    all dataset rows before the first step (``prepare_rewards``; module
    docs of :mod:`storyrl.rewards.base`). Returns the counts per reward, or
    None when the option is off."""
    if not config.prepare_rewards:
        return None
    from storyrl.rewards.base import RewardError
    from storyrl.rewards.base import prepare_rewards as prepare

    plain = dataset.with_format(None) if hasattr(dataset, "with_format") else dataset  # no VLM image transform
    names = getattr(plain, "column_names", None) or (list(plain[0]) if len(plain) else [])
    context = {c: list(plain[c]) for c in PREPARE_COLUMNS if c in names}
    context = {c: v for c, v in context.items() if any(x is not None for x in v)}  # e.g. no image ids
    try:
        counts = prepare(rewards, context, progress=progress and is_main_process())
    except RewardError as exc:
        raise ValueError(str(exc)) from exc
    logger.info("rewards prepared over %d rows: %s", len(plain), counts)
    return counts


def run_trl(config: RLConfig, policy, dataset, rewards, resume: bool, progress: bool,
            callbacks: list | None) -> RLResult:
    """GRPO/RLOO through TRL's trainers (:func:`~storyrl.training.storyteller.rl.trl_trainers.train_trl`)."""
    from storyrl.training.storyteller.rl.trl_trainers import train_trl

    trainer = train_trl(config, policy, dataset, rewards, resume=resume, progress=progress, callbacks=callbacks)
    return RLResult(algorithm=config.algorithm, output_dir=config.output_dir, steps=trainer.state.global_step,
                    history=list(trainer.state.log_history))


def run_ppo(config: RLConfig, policy, dataset, rewards, resume: bool, progress: bool,
            callbacks: list | None = None) -> RLResult:
    """storyrl's PPO (it writes history.jsonl with the story statistics and
    samples.jsonl itself); ``callbacks`` are refused before (:class:`Algorithm`)."""
    from storyrl.training.storyteller.rl.policy import lora_config, merge_adapters
    from storyrl.training.storyteller.rl.ppo import PPOTrainer, find_latest_checkpoint

    if resume and find_latest_checkpoint(config.output_dir) is None:
        logger.warning("resume: no checkpoint-<step>/ in %s; starting from the beginning", config.output_dir)
        resume = False
    trainer = PPOTrainer(
        model=policy.model,
        reward_funcs=rewards,
        args=config.ppo,
        train_dataset=dataset,
        processing_class=policy.processing_class,
        peft_config=lora_config(config, policy.kind),
        reward_weights=config.reward_weights,
    )
    result = trainer.train(resume=resume, progress=progress)
    final = Path(config.output_dir) / "final"
    trainer.save_model(final)
    if trainer.accelerator.is_main_process:
        if config.lora.enabled and config.lora.merge:
            merge_adapters(config, final, policy.kind)
        from storyrl.training.model_card import write_model_card

        write_model_card(final, config, "rl", steps=result.steps)
        config.to_yaml(final / CONFIG_FILE)  # last: final/ is complete
    return RLResult(algorithm="ppo", output_dir=config.output_dir, steps=result.steps, history=list(result.history))


TRAINER = Trainer(
    RLConfig, train,
    outputs="Checkpoints OUTPUT_DIR/checkpoint-<step>, the resolved config OUTPUT_DIR/rl_config.yaml, one JSON line "
            "per logged step in OUTPUT_DIR/history.jsonl and the trained policy in OUTPUT_DIR/final.",
    config_file="configs/rl/<name>.yaml",
    resume_help="Continue from the latest OUTPUT_DIR/checkpoint-<step>.",
)
