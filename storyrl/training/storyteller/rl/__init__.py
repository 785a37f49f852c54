"""RL fine-tuning of story generators against storyrl rewards:
``storyrl train rl --config configs/rl/<name>.yaml`` (trainer ``rl``).

* :mod:`~storyrl.training.storyteller.rl.config`: :class:`RLConfig` -- algorithm
  (``ppo``, ``grpo``, ``rloo``), policy, data and prompts, rewards, and the
  algorithm's own config as a nested mapping (storyrl's ``PPOConfig``, TRL's
  ``GRPOConfig`` / ``RLOOConfig``); run-level keys (output_dir, seed,
  max_steps, report_to, reward_weights) are set once at the top level.
  :data:`~storyrl.training.storyteller.rl.config.ALGORITHMS` is the one table of the
  algorithms (config class, run function), read by the choices, the nested
  keys and the dispatch of :func:`~storyrl.training.storyteller.rl.train.train`.
* :mod:`~storyrl.training.storyteller.rl.policy`: loading policies -- any transformers
  causal LM, vision-language models (LLaVA-NeXT-style, conversational
  prompts with the sequence's images) and storyrl's TAPM-style generator;
  4-bit bases (bitsandbytes), LoRA (peft; the reference is the base with the
  adapters disabled, no second copy); :func:`generate_stories` from a
  trained policy (the ablation runner's evaluation).
* :mod:`~storyrl.training.storyteller.rl.data`: the prompt dataset every algorithm
  consumes (prompt, images, story_images, reference, story_id, image_ids),
  built with the generators' prompt templates and sequence images.
* :mod:`~storyrl.training.storyteller.rl.trl_trainers`: GRPO and RLOO through TRL's
  trainers with storyrl rewards as reward functions and the story monitor.
* :mod:`~storyrl.training.storyteller.rl.sampling`: rollouts sampled on merged LoRA
  weights, the base restored bit for bit (``merge_adapters_for_sampling``;
  PPO and GRPO/RLOO with transformers), and TRL's vLLM weight sync kept off
  the base weights.
* :mod:`~storyrl.training.storyteller.rl.vllm_options`: GRPO/RLOO's ``use_vllm`` and
  ``vllm_*`` keys checked when the config is read.
* :mod:`~storyrl.training.storyteller.rl.ppo`: PPO on accelerate (TRL 1.16 has none),
  a subpackage: its config (:mod:`~storyrl.training.storyteller.rl.ppo.config`), the
  trainer (:mod:`~storyrl.training.storyteller.rl.ppo.trainer`), pure math
  (:mod:`~storyrl.training.storyteller.rl.ppo.math`), rollouts, value models, reward
  calls and checkpoints.
* :mod:`~storyrl.training.storyteller.rl.monitor`: the signs of reward hacking logged at
  every step (story length, distinct-n, sample stories; KL from the
  trainers, unscorable fractions from the rewards).
* :mod:`~storyrl.training.storyteller.rl.train`: :func:`train` and the registered
  :data:`TRAINER`.

TAPM policies train with PPO only: TRL's trainers patch the forward of a
``PreTrainedModel`` driven by ``input_ids`` alone, and TAPM needs its visual
features. The rewards are :class:`storyrl.rewards.Reward` objects, TRL
reward functions as they are. Layers point down: trainers use rewards and
generators, never the reverse.
"""
