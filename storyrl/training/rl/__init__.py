"""RL fine-tuning of story generators against storyrl rewards (the home of
the RL trainers; filled in by the RL issue).

Layout the trainers follow:

* the policy is a :class:`storyrl.generators.Generator`'s model (a causal LM,
  a vision-language model or the TAPM-style generator), the rewards are
  :class:`storyrl.rewards.Reward` objects -- TRL reward functions as they
  are (``reward(prompts=..., completions=..., **columns)`` returns
  ``list[float | None]``);
* each algorithm's config is a :class:`storyrl.config.Config` dataclass that
  embeds TRL's own config dataclass as a field (``GRPOConfig``,
  ``RLOOConfig``), so that one YAML file sets both;
* each algorithm registers a :class:`storyrl.training.Trainer` in
  :data:`storyrl.training.TRAINERS`, which gives it ``storyrl train <name>``.

Layers point down: trainers use rewards and generators, never the reverse.
"""
