"""RL fine-tuning against storyrl rewards and training of learned metrics (to come)."""
