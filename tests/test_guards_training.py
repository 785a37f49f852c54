"""Guards for training code against realistic bugs, each checked against a
hand computation or a plainly written reference: PPO checkpoint discovery
and rotation, the GRPO/RLOO per-epoch prompt order, the story monitor
(distinct-n, story statistics, samples), and TAPM's adaptation hinge loss
(its value and which side gets the gradient)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import storyrl  # noqa: F401  (torchvision fallback before transformers / trl)

torch = pytest.importorskip("torch")


# -- PPO checkpoints ---------------------------------------------------------------------------


def _checkpoint(root: Path, name: str, complete: bool = True) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "model.bin").write_text("weights")
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"step": name}))
    return path


def test_find_latest_checkpoint_is_the_numerically_highest_complete_one(tmp_path):
    from storyrl.training.storyteller.rl.ppo.checkpoints import find_latest_checkpoint

    assert find_latest_checkpoint(tmp_path) is None
    for step in (2, 10, 9):
        _checkpoint(tmp_path, f"checkpoint-{step}")
    # lexicographic order would give 9, the oldest-first order 2
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    # incomplete ones are ignored: no trainer_state.json, a .tmp left by a crash (even with its state), junk
    _checkpoint(tmp_path, "checkpoint-11", complete=False)
    _checkpoint(tmp_path, "checkpoint-12.tmp")
    _checkpoint(tmp_path, "checkpoint-latest")
    (tmp_path / "checkpoint-13").write_text("a file, not a checkpoint")
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    _checkpoint(tmp_path, "checkpoint-100")
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-100"


class FakeAccelerator:
    """What save_checkpoint uses of accelerate's Accelerator."""

    def __init__(self, main: bool = True) -> None:
        self.is_main_process = main
        self.saved: list[str] = []
        self.waits = 0

    def wait_for_everyone(self) -> None:
        self.waits += 1

    def save_state(self, directory: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "state.bin").write_text(directory)
        self.saved.append(directory)


def test_save_checkpoint_writes_aside_then_keeps_the_newest(tmp_path):
    from storyrl.training.storyteller.rl.ppo.checkpoints import TRAINER_STATE, find_latest_checkpoint, save_checkpoint

    acc = FakeAccelerator()
    for step in (2, 9, 10, 11):
        final = save_checkpoint(acc, tmp_path, step, {"step": step, "kl_coef": 0.05}, keep=2)
        assert final == tmp_path / f"checkpoint-{step}"
        assert json.loads((final / TRAINER_STATE).read_text()) == {"step": step, "kl_coef": 0.05}
    assert acc.saved == [str(tmp_path / f"checkpoint-{s}.tmp") for s in (2, 9, 10, 11)]  # written aside
    # the two newest, in numeric order (a lexicographic one would keep 9 and 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-11"]
    assert (tmp_path / "checkpoint-11" / "state.bin").read_text() == str(tmp_path / "checkpoint-11.tmp")
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-11"
    # keep=1 after more saves; keep=None keeps everything
    save_checkpoint(acc, tmp_path, 12, {"step": 12}, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-12"]
    save_checkpoint(acc, tmp_path, 13, {"step": 13})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12", "checkpoint-13"]
    # the same step again replaces it; a stale .tmp of an earlier crash is cleared first
    _checkpoint(tmp_path, "checkpoint-14.tmp")
    save_checkpoint(acc, tmp_path, 14, {"step": 14}, keep=3)
    assert sorted(p.name for p in (tmp_path / "checkpoint-14").iterdir()) == ["state.bin", TRAINER_STATE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12", "checkpoint-13", "checkpoint-14"]


def test_save_checkpoint_on_another_process_neither_renames_nor_deletes(tmp_path):
    from storyrl.training.storyteller.rl.ppo.checkpoints import save_checkpoint

    for step in (1, 2, 3):
        _checkpoint(tmp_path, f"checkpoint-{step}")
    other = FakeAccelerator(main=False)
    save_checkpoint(other, tmp_path, 4, {"step": 4}, keep=1)
    assert other.waits >= 2  # every process meets the barriers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3",
                                                         "checkpoint-4.tmp"]


# -- GRPO / RLOO prompt order per epoch -----------------------------------------------------------


def _sampler_trainer(seed: int, n: int = 12, batch_size: int = 4, mini_repeat: int = 2, repeat: int = 1):
    """A stand-in for a TRL trainer: ``_get_train_sampler`` gives TRL's
    RepeatSampler, ``state.epoch`` is what transformers keeps."""
    from trl.trainer.utils import RepeatSampler

    from storyrl.training.storyteller.rl.trl_trainers import _resumable

    class Trainer:
        def __init__(self) -> None:
            self.state = SimpleNamespace(epoch=None)

        def _get_train_sampler(self, dataset=None):
            return RepeatSampler(list(range(n)), mini_repeat_count=mini_repeat, batch_size=batch_size,
                                 repeat_count=repeat, shuffle=True, seed=seed)

    return _resumable(Trainer)()


def _documented_order(seed: int, epoch: int, n: int = 12, batch_size: int = 4, mini_repeat: int = 2,
                      repeat: int = 1) -> list[int]:
    """The module's rule written out: epoch k's permutation from a generator
    seeded ``seed + k``, in batches, each batch repeated ``repeat`` times
    and each index ``mini_repeat`` times."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    out = []
    for start in range(0, n - n % batch_size, batch_size):
        for _ in range(repeat):
            for index in perm[start:start + batch_size]:
                out += [index] * mini_repeat
    return out


def test_each_epoch_reads_the_prompts_in_the_order_of_seed_plus_epoch():
    trainer = _sampler_trainer(seed=7, repeat=2)
    sampler = trainer._get_train_sampler()
    orders = []
    for epoch in range(3):
        trainer.state.epoch = float(epoch) if epoch else None  # transformers' state.epoch is None before training
        orders.append(list(sampler))
        assert orders[-1] == _documented_order(7, epoch, repeat=2), epoch
    assert orders[0] != orders[1] != orders[2]
    assert sorted(orders[0]) == sorted(orders[1])  # the same prompts, another order
    # a fractional epoch (mid-epoch) is that epoch; the next seed gives another run's order
    trainer.state.epoch = 1.5
    assert list(sampler) == orders[1]
    assert list(_sampler_trainer(seed=8)._get_train_sampler()) == _documented_order(8, 0)


def test_a_resumed_run_reads_the_uninterrupted_runs_order():
    uninterrupted = _sampler_trainer(seed=3)
    sampler = uninterrupted._get_train_sampler()
    seen = {}
    for epoch in range(3):
        uninterrupted.state.epoch = float(epoch)
        seen[epoch] = list(sampler)
    # resumed from a checkpoint in epoch 2 (restored state.epoch 2.25): a fresh trainer and sampler
    resumed = _sampler_trainer(seed=3)
    resumed.state.epoch = 2.25
    assert list(resumed._get_train_sampler()) == seen[2]
    # TRL's own sampler would have replayed epoch 0's order here
    assert seen[2] != seen[0]


# -- the story monitor -----------------------------------------------------------------------------


def test_distinct_n_by_hand():
    from storyrl.training.storyteller.rl.monitor import distinct_n

    stories = [["a", "b", "a", "b"], ["c", "a", "b"]]
    # unigrams a b a b c a b: 7, distinct {a, b, c}
    assert distinct_n(stories, 1) == pytest.approx(3 / 7)
    # bigrams ab ba ab | ca ab: 5, distinct {ab, ba, ca}
    assert distinct_n(stories, 2) == pytest.approx(3 / 5)
    # trigrams aba bab | cab: 3, all distinct
    assert distinct_n(stories, 3) == pytest.approx(1.0)
    # each story's last n-gram counts: here it is the only repeat
    assert distinct_n([["x", "y", "x"]], 1) == pytest.approx(2 / 3)
    assert distinct_n([["x", "y", "x", "y"]], 2) == pytest.approx(2 / 3)  # xy yx xy
    assert distinct_n([["p", "q", "r", "p", "q", "r"]], 3) == pytest.approx(3 / 4)  # pqr qrp rpq pqr
    # a story as long as n has exactly one n-gram; shorter ones none
    assert distinct_n([["u", "v"], ["u"], []], 2) == pytest.approx(1.0)
    assert distinct_n([["u", "v"], ["u", "v"]], 2) == pytest.approx(0.5)
    assert math.isnan(distinct_n([["u"], []], 2)) and math.isnan(distinct_n([], 1))


def test_story_stats_by_hand():
    from storyrl.training.storyteller.rl.monitor import story_stats

    texts = ["The dog ran. The dog ran.", "", None, "One", "   "]
    stats = story_stats(texts, token_lengths=[5, 0, 2, 1, 2])
    # words (lower-cased, punctuation as tokens): the dog ran . the dog ran . | - | - | one | -
    want = {
        "story/sentences_mean": (2 + 0 + 0 + 1 + 0) / 5,
        "story/words_mean": (8 + 1) / 5,
        "story/empty_frac": 3 / 5,
        "story/one_sentence_frac": 1 / 5,
        "story/distinct_1": 5 / 9,  # the dog ran . one
        "story/distinct_2": 4 / 7,  # the-dog dog-ran ran-. .-the; "one" has none
        "story/distinct_3": 4 / 6,  # the-dog-ran dog-ran-. ran-.-the .-the-dog
        "story/tokens_mean": 10 / 5,
    }
    assert stats == pytest.approx(want)
    assert set(stats) == set(want)
    assert "story/tokens_mean" not in story_stats(texts)
    empty = story_stats([None, ""])
    assert empty["story/empty_frac"] == 1.0 and math.isnan(empty["story/distinct_1"])


def test_sample_stories_by_hand():
    from storyrl.training.storyteller.rl.monitor import sample_stories

    got = sample_stories(["a", None, "c", "d"], [0.5, math.nan, None, 2.0], k=3)
    assert got == [{"story": "a", "reward": 0.5}, {"story": "", "reward": None}, {"story": "c", "reward": None}]
    assert sample_stories(["a"], [1], k=5) == [{"story": "a", "reward": 1.0}]
    assert sample_stories(["a", "b"], [1.0, 2.0], k=0) == []


def test_story_monitor_logs_stats_and_writes_weighted_samples(tmp_path):
    from storyrl.training.storyteller.rl.trl_trainers import StoryMonitor

    def first(prompts=None, completions=None, **kw):
        return [1.0, None, 3.0]

    def second(prompts=None, completions=None, **kw):
        return [0.5, None, float("nan")]

    monitor = StoryMonitor([2.0, -1.0], tmp_path / "samples.jsonl", num_samples=2)
    rewards = monitor.wrap([first, second])
    assert [r.__name__ for r in rewards] == ["first", "second"]
    logged = {}
    kwargs = {"completion_ids": [[1, 2, 3], [4], [5, 6]], "log_metric": logged.__setitem__,
              "trainer_state": SimpleNamespace(global_step=4)}
    completions = ["The dog ran. The dog ran.", "", "One"]
    assert rewards[0](prompts=["p"] * 3, completions=completions, **kwargs) == [1.0, None, 3.0]
    rewards[1](prompts=["p"] * 3, completions=completions, **kwargs)
    # statistics from the first reward's call; NaN ones (none here) left out
    assert logged["story/tokens_mean"] == pytest.approx(2.0)
    assert logged["story/empty_frac"] == pytest.approx(1 / 3)
    assert logged["story/distinct_1"] == pytest.approx(5 / 9)
    # totals as TRL forms them: None rewards left out, None when none scored
    totals = monitor.totals()
    assert totals[0] == pytest.approx(2.0 * 1.0 - 1.0 * 0.5) and totals[1] is None and math.isnan(totals[2])
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [{"step": 5, "samples": [
        {"story": completions[0], "reward": 1.5, "rewards": {"first": 1.0, "second": 0.5}},
        {"story": "", "reward": None, "rewards": {"first": None, "second": None}}]}]
    with pytest.raises(ValueError, match="2 reward weights for 1 rewards"):
        monitor.wrap([first])


# -- TAPM adaptation loss --------------------------------------------------------------------------


def test_ranking_hinge_by_hand():
    from storyrl.generators.tapm.losses import ranking_hinge

    # a (visual) normalises to (1,0), (0,1); b (decoder) to (1,0), (0.6,0.8); slot 3 is padding (junk)
    a = torch.tensor([[[5.0, 0.0], [0.0, 0.5], [3.0, -7.0]]])
    b = torch.tensor([[[2.0, 0.0], [3.0, 4.0], [-1.0, 9.0]]])
    mask = torch.tensor([[True, True, False]])
    # s[i][j] = cos(a_i, b_j): s00 1, s01 0.6, s10 0, s11 0.8
    rows = [max(0.0, 1 + 0.6 - 1), max(0.0, 1 + 0.0 - 0.8)]  # anchor a_i, negative b_j
    cols = [max(0.0, 1 + 0.0 - 1), max(0.0, 1 + 0.6 - 0.8)]  # anchor b_i, negative a_j
    loss, correct, anchors = ranking_hinge(a, b, mask, mask, margin=1.0)
    assert loss.item() == pytest.approx(sum(rows + cols) / 4)  # 0.4
    assert (correct, anchors) == (4, 4)
    # margin 0.5: each term by hand (two of the four clamp to 0)
    loss, _, _ = ranking_hinge(a, b, mask, mask, margin=0.5)
    terms = [max(0.0, 0.5 + 0.6 - 1), max(0.0, 0.5 - 0.8), max(0.0, 0.5 - 1), max(0.0, 0.5 + 0.6 - 0.8)]
    assert loss.item() == pytest.approx(sum(terms) / 4)
    # a mismatched pairing ranks badly: swap b's two positions
    loss, correct, _ = ranking_hinge(a, b[:, [1, 0, 2]], mask, mask)
    # s'00 0.6, s'01 1, s'10 0.8, s'11 0
    swapped = [1 + 1 - 0.6, 1 + 0.8 - 0, 1 + 0.8 - 0.6, 1 + 1 - 0]
    assert loss.item() == pytest.approx(sum(swapped) / 4) and correct == 0


def test_adaptation_loss_by_hand_with_a_direction():
    from storyrl.generators.tapm.losses import adaptation_loss

    pooled = torch.tensor([[[5.0, 0.0], [0.0, 0.5]]])
    h = torch.tensor([[[2.0, 0.0], [3.0, 4.0]]])
    mask = torch.tensor([[True, True]])
    # direction +1: image 1's token (0, 1) is ranked against sentence 0 (1, 0), sentence 1 (0.6, 0.8) the negative
    directions = {1: torch.tensor([[[7.0, 7.0], [0.0, 2.0]]])}
    loss, counts = adaptation_loss(h, pooled, {}, mask)
    assert loss.item() == pytest.approx(0.4) and counts == {"correct": 4, "n": 4}
    loss, _ = adaptation_loss(h, pooled, directions, mask)
    assert loss.item() == pytest.approx(0.4 + (1 + 0.8 - 0.0))


def test_adaptation_loss_trains_the_visual_side_only():
    """The decoder state is a fixed target (detached); the gradient reaches
    the visual encoder's parameters through the hinge, never the decoder's."""
    from storyrl.generators.tapm.encoder import VisualEncoder
    from storyrl.generators.tapm.losses import adaptation_loss

    torch.manual_seed(0)
    encoder = VisualEncoder({"image": 6}, width=8, hidden_size=8, offsets=[-1, 1], blocks=1, dropout=0.0)
    decoder = torch.nn.Linear(5, 8)  # stands in for the decoder's state at each sentence's start token
    mask = torch.tensor([[True, True, True], [True, True, False]])
    _, pooled, directions = encoder({"image": torch.randn(2, 3, 2, 6)}, mask)
    h = decoder(torch.randn(2, 3, 5))
    loss, _ = adaptation_loss(h, pooled, directions, mask)
    assert loss.item() > 0
    loss.backward()
    assert decoder.weight.grad is None and decoder.bias.grad is None
    grads = {n: p.grad for n, p in encoder.named_parameters() if n.startswith(("encoders.", "pooling."))}
    assert grads and all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert all(g.abs().sum() > 0 for g in grads.values())


def test_adaptation_step_sends_the_gradient_through_the_visual_encoding():
    """storyrl.training.storyteller.tapm's adaptation step on a tiny TAPM: the loss is the
    hinge between the decoder's start-token state and the visual encoding,
    and its gradient reaches the visual encoder through the pooled encoding
    (the story-global linear feeds nothing else), never the decoder."""
    import tiny_models

    from storyrl.generators.tapm.losses import adaptation_loss
    from storyrl.generators.tapm.model import TapmModel
    from storyrl.training.storyteller.tapm import _Step

    tokenizer = tiny_models.chat_tokenizer(tiny_models.TAPM_TEXTS)
    model = TapmModel.from_decoder(tiny_models.tiny_gpt2(tokenizer), tokenizer, {"image": 6}, {"image": 2},
                                   dropout=0.0, seed=0)
    model.set_stage("adaptation")
    model.eval()  # no dropout: the reference below sees the same numbers
    torch.manual_seed(1)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    features = {"image": torch.randn(2, 3, 2, 6)}
    P = model.encode(features, mask)[0].shape[2]
    n = int(mask.sum())
    start = model.config.start_token_id
    ids = torch.full((n, P + 3), start)
    ids[:, P + 1:] = torch.randint(0, len(tokenizer), (n, 2))
    batch = {"features": features, "image_mask": mask, "input_ids": ids,
             "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    loss, counts = _Step("adaptation", margin=1.0)(model, batch)
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.visual.named_parameters() if p.grad is not None}
    assert all(p.grad is None for p in model.decoder.parameters())
    assert got["pooling.image.global_linear.weight"].abs().sum() > 0  # through the pooled encoding
    # the same by hand: the decoder's last hidden state at the start token (after the prefix), as a constant
    model.zero_grad()
    prefix, pooled, directions = model.encode(features, mask)
    with torch.no_grad():
        states = model(input_ids=ids, visual_prefix=prefix[mask], output_hidden_states=True,
                       use_cache=False).hidden_states[-1][:, P]
    h = torch.zeros_like(pooled)
    h[mask] = states
    want, want_counts = adaptation_loss(h, pooled, directions, mask, 1.0)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5) and counts == want_counts
    want.backward()
    for name, grad in got.items():
        torch.testing.assert_close(grad, model.visual.get_parameter(name).grad, rtol=1e-4, atol=1e-6)


def test_ppo_rollouts_sample_with_the_configured_top_k_top_p_and_temperature():
    from storyrl.training.storyteller.rl.ppo.rollout import _generation_config

    args = SimpleNamespace(response_length=12, temperature=0.7, top_p=0.9, top_k=7)
    config = _generation_config(args, stop_token_id=2, pad_token_id=0)
    assert (config.top_k, config.top_p, config.temperature, config.max_new_tokens) == (7, 0.9, 0.7, 12)
    assert config.do_sample is True and config.eos_token_id == [2] and config.pad_token_id == 0
    assert _generation_config(SimpleNamespace(**{**vars(args), "top_k": 0}), None, 0).top_k == 0  # 0: off
