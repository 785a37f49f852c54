"""A run whose loss or weights become NaN/inf stops in one line and writes
no final/ (issue 31, item 4), for every trainer: SFT, DPO, the reward model,
GRPO, PPO and the fit loop. Each run passes config validation (a huge but
finite learning rate: 1e39 overflows float32 at the first update, 1e30 at
the second step's forward) or has its loss made NaN by hand.

Tiny random-weight models (tests/tiny_models.py)."""

from __future__ import annotations

import math

import pytest
from test_training_resume import assets, rl, rl_assets, storyteller  # noqa: F401  (assets, rl_assets: fixtures)

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

pytestmark = pytest.mark.usefixtures("trl_offline")

DIVERGED = r"^step \d+: training diverged: "


def assert_no_final(out) -> None:
    assert not (out / "final").exists()
    assert not [p for p in out.glob("checkpoint-*")
                if "nan" in (p / "trainer_state.json").read_text().lower()]  # no diverged step was saved


@pytest.mark.parametrize("kind,extra", [
    ("sft", {"learning_rate": 1e30, "max_steps": 2}),  # step 1: weights ~1e30; step 2: the forward overflows
    ("sft", {"learning_rate": 1e39}),
    ("dpo", {"learning_rate": 1e39}),
], ids=["sft-1e30", "sft-1e39", "dpo-1e39"])
def test_a_diverging_storyteller_run_stops_without_final(assets, tmp_path, kind, extra):
    config, train = storyteller(kind, assets, tmp_path / "run", **extra)
    with pytest.raises(ValueError, match=DIVERGED) as info:
        train(config, progress=False)
    assert "\n" not in str(info.value) and "lower the learning rate" in str(info.value)
    assert_no_final(tmp_path / "run")


def test_steps_after_the_last_logged_one_are_checked_at_the_end(assets, tmp_path):
    """transformers logs every logging_steps only (no forced log at
    max_steps): a run that diverges after its last log is caught by the
    end-of-training check, before final/."""
    config, train = storyteller("sft", assets, tmp_path / "run", learning_rate=1e39, logging_steps=10,
                                save_steps=10)
    with pytest.raises(ValueError, match=DIVERGED):
        train(config, progress=False)
    assert_no_final(tmp_path / "run")
    history = tmp_path / "run" / "history.jsonl"
    assert not history.exists() or '"loss"' not in history.read_text()


def test_the_diverged_step_leaves_no_history_record(assets, tmp_path):
    """The guard runs before the log line is written: history.jsonl never
    shows a step that was refused."""
    config, train = storyteller("sft", assets, tmp_path / "run", learning_rate=1e39)
    with pytest.raises(ValueError, match=DIVERGED):
        train(config, progress=False)
    history = tmp_path / "run" / "history.jsonl"
    assert not history.exists() or not [line for line in history.read_text().splitlines() if '"loss"' in line]


def test_a_nan_loss_stops_the_run_although_the_logged_loss_hides_it(assets, tmp_path, monkeypatch):
    """transformers' logging_nan_inf_filter logs the mean of the earlier
    losses in place of a NaN one: the weights tell."""
    from trl import SFTTrainer

    compute_loss = SFTTrainer.compute_loss

    def nan_loss(self, *args, **kwargs):
        out = compute_loss(self, *args, **kwargs)
        return (out[0] * math.nan, *out[1:]) if isinstance(out, tuple) else out * math.nan

    monkeypatch.setattr(SFTTrainer, "compute_loss", nan_loss)
    config, train = storyteller("sft", assets, tmp_path / "run")
    with pytest.raises(ValueError, match=DIVERGED + r"\d+ trainable weight tensor\(s\) hold NaN/inf"):
        train(config, progress=False)
    assert_no_final(tmp_path / "run")


def test_a_diverging_reward_model_stops_without_final(assets, tmp_path):
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig, train

    config = RewardModelRunConfig.from_mapping({
        "model": assets["model"], "pairs": assets["pairs"], "output_dir": str(tmp_path / "run"), "max_steps": 1,
        "batch_size": 2, "learning_rate": 1e39, "logging_steps": 1, "eval_fraction": 0.0, "seed": 0})
    with pytest.raises(ValueError, match=DIVERGED):
        train(config, progress=False)
    assert_no_final(tmp_path / "run")


def test_a_diverging_grpo_run_stops_without_final(rl_assets, tmp_path):  # noqa: F811
    config, train = rl(rl_assets, tmp_path / "run", "grpo")
    section = config.to_dict()["grpo"]
    config, _ = rl(rl_assets, tmp_path / "run", "grpo", grpo={**section, "learning_rate": 1e39})
    with pytest.raises(ValueError, match=DIVERGED):
        train(config, progress=False)
    assert not (tmp_path / "run" / "final").exists() and not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_nan_ppo_update_stops_before_final(rl_assets, tmp_path, monkeypatch):  # noqa: F811
    """PPO's own check reads the next step's log-probabilities; the last
    step's NaN weights are caught before they are saved."""
    from storyrl.training.storyteller.rl.ppo import math as ppo_math

    policy_loss = ppo_math.policy_loss

    def nan_loss(*args, **kwargs):
        loss, *rest = policy_loss(*args, **kwargs)
        return (loss * math.nan, *rest)

    monkeypatch.setattr(ppo_math, "policy_loss", nan_loss)
    config, train = rl(rl_assets, tmp_path / "run", "ppo")
    with pytest.raises(ValueError, match=r"^step 1: training diverged: \d+ trainable weight tensor"):
        train(config, progress=False)
    assert not (tmp_path / "run" / "final").exists() and not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_diverging_fit_loop_stops(tmp_path):
    import torch

    from storyrl.training.config import TrainConfig
    from storyrl.training.loop import fit

    torch.manual_seed(0)
    data = [(torch.randn(2), int(k % 2)) for k in range(16)]
    calls = []

    def step(model, batch):  # the loss overflows at the second training step
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        calls.append(model.training)
        return (loss * math.inf if calls.count(True) == 2 and model.training else loss), {}

    config = TrainConfig(output_dir=str(tmp_path / "run"), epochs=2, batch_size=4)
    with pytest.raises(ValueError, match=r"^epoch 1 step 2: training diverged: the loss is inf"):
        fit(torch.nn.Linear(2, 2), data, data[:4], config, step, progress=False)
    assert not (tmp_path / "run" / "best").exists() and not (tmp_path / "run" / "last").exists()


def test_nonfinite_weights_names_the_trainable_ones_by_hand():
    import torch

    from storyrl.training.guards import check_finite_weights, nonfinite_weights

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3),
                                torch.nn.Embedding(4, 2))
    with torch.no_grad():
        model[0].weight[1, 2] = math.nan
        model[1].bias[0] = -math.inf
        model[2].weight[0, 0] = math.nan
        model[3].weight[3, 1] = 3e38  # large, finite
    model[2].weight.requires_grad_(False)  # frozen: not this run's doing
    assert nonfinite_weights(model) == ["0.weight", "1.bias"]
    with pytest.raises(ValueError, match=r"^step 7: training diverged: 2 trainable weight tensor\(s\) hold NaN/inf "
                                         r"\(first: 0.weight\)"):
        check_finite_weights(model, "step 7")
    with torch.no_grad():
        model[0].weight[1, 2] = 0.0
        model[1].bias[0] = 0.0
    assert nonfinite_weights(model) == []
    check_finite_weights(model, "step 8")
