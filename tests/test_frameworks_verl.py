"""storyrl's verl adapter inside released verl: verl's own config (Hydra over
its YAML), reward loader, reward loop workers and reward managers, and GDPO's
advantage (see tests/frameworks.py for how the wheels are installed). The
expected values are storyrl's rewards computed here, directly, on the stories
verl decoded."""

from __future__ import annotations

import math

import numpy as np
import pytest

from storyrl.integrations import verl as adapter
from storyrl.rewards import create_reward, load_reward_config
from tests.frameworks import framework_path, run_check
from tests.tiny_models import chat_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STORIES = [
    "The family went to the beach . The kids built a castle . The sun was warm .",
    "We went to the park . We went to the park . We went to the park .",
    "A dog ran on the sand . It found a red ball . Everyone laughed .",
    "The beach was warm and the kids ran . The dog found the ball .",
    "They built a castle on the sand . The castle fell . The kids laughed .",
    "The sun was red . The sun was red .",
]
HUMAN = [
    "The family spent a day at the beach . The kids built a sand castle .",
    "The family spent a day at the beach . The kids built a sand castle .",
    "A dog played on the beach . It found a red ball .",
    "A dog played on the beach . It found a red ball .",
    "The kids built a castle . They watched it fall and laughed .",
    "The kids built a castle . They watched it fall and laughed .",
]
IDS = ["s1", "s1", "s2", "s2", "s3", "s3"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("verl_tokenizer")
    chat_tokenizer(STORIES + HUMAN).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("verl_configs")
    files = {
        "repetition": "reward: repetition\n",
        "dhm": "reward: dhm\ndimensions: [repetition]\n",
        "group": ("reward: weighted\ncomponents:\n"
                  "  - {reward: rouge_l, weight: 0.7, normalize: group}\n"
                  "  - {reward: repetition, weight: 0.3, normalize: group}\n"),
        "mixed": ("reward: weighted\ncomponents:\n"
                  "  - {reward: rouge_l, weight: 0.7, normalize: group}\n"
                  "  - {reward: repetition, weight: 0.3}\n"),
    }
    for name, text in files.items():
        (d / f"{name}.yaml").write_text(text)
    return {name: d / f"{name}.yaml" for name in files}


def samples(ground_truth_key: str = "reference", uid: bool = True):
    out = []
    for i, (story, human, sid) in enumerate(zip(STORIES, HUMAN, IDS)):
        sample = {"story": story, "ground_truth": human, "extra_info": {"story_id": sid, "index": i}}
        if uid:
            sample["uid"] = sid
        out.append(sample)
    return out


def verl_job(mode, overrides, tokenizer_dir, **extra):
    return {"mode": mode, "samples": samples(),
            "overrides": [*overrides, f"actor_rollout_ref.model.path={tokenizer_dir}", "reward.num_workers=2"],
            **extra}


def direct(config, stories, **context):
    reward = load_reward_config(config).setup()
    return reward.score(stories, **context), reward


WAIT = "++reward.custom_reward_function.reward_kwargs.storyrl_wait_ms=500"


@pytest.fixture(scope="module")
def verl_091(configs, tokenizer_dir):
    """Every verl 0.9.1 job of this module, run in turn in one process (importing verl is most of a
    job's time); each test reads its job's result."""
    jobs = {
        "compute_score_async": verl_job("loop", [*adapter.overrides(configs["dhm"], function="compute_score_async"),
                                                 WAIT], tokenizer_dir),
        "compute_score": verl_job("loop", [*adapter.overrides(configs["dhm"], function="compute_score"), WAIT],
                                  tokenizer_dir),
        "plain": verl_job("loop", adapter.overrides(configs["repetition"]), tokenizer_dir),
        "group_without_gdpo": verl_job("loop", adapter.overrides(configs["group"], gdpo=False), tokenizer_dir),
        "gdpo": verl_job("loop", adapter.overrides(configs["group"]), tokenizer_dir, gdpo=True),
        "resolve_legacy_keys": verl_job("resolve", [*adapter.overrides(configs["repetition"], "0.6.1"),
                                                    "reward_model.reward_manager=batch"], tokenizer_dir),
        "resolve_batch_manager": verl_job("resolve", ["reward.reward_manager.name=batch"], tokenizer_dir),
        "resolve_new_keys": verl_job("resolve", adapter.overrides(configs["repetition"]), tokenizer_dir),
    }
    out = run_check("verl_reward.py", {"jobs": list(jobs.values())}, framework_path("verl", "0.9.1"))
    assert len(out["results"]) == len(jobs)
    return {name: {**result, "verl": out["verl"]} for name, result in zip(jobs, out["results"])}


@pytest.mark.parametrize("function", ["compute_score_async", "compute_score"])
def test_reward_loop_scores_equal_the_reward(function, configs, verl_091):
    out = verl_091[function]
    assert "error" not in out, out["error"]
    assert out["verl"] == "0.9.1" and out["manager"] == "NaiveRewardManager"
    expected, reward = direct(configs["dhm"], out["stories"], reference=HUMAN)
    np.testing.assert_allclose(out["scores"], expected, rtol=1e-6)  # verl keeps float32
    # the dict's keys, stacked by verl per sample: total, components, unscorable
    assert out["extra"]["score"] == pytest.approx(list(expected))
    assert out["extra"]["unscorable"] == [0.0] * len(STORIES)
    assert out["extra"]["dhm/repetition"] == pytest.approx(list(reward.last_components["repetition"]))
    # the reward sits on each response's last valid token
    nonzero = [i for i, v in enumerate(out["scores"]) if v != 0]
    assert nonzero and [out["positions"][i] for i in nonzero] == [out["lengths"][i] - 1 for i in nonzero]
    if function == "compute_score_async":
        # verl's worker gathers its chunk's samples: one reward call per chunk, not per story
        assert sum(out["batch_sizes"]) == len(STORIES) and max(out["batch_sizes"]) > 1
    else:
        assert out["batch_sizes"] == []


def test_plain_reward_gives_floats_through_verl(configs, verl_091):
    out = verl_091["plain"]
    expected, _ = direct(configs["repetition"], out["stories"])
    np.testing.assert_allclose(out["scores"], expected, rtol=1e-6)
    assert set(out["extra"]) == {"acc"}  # verl's name for a float result


def test_group_normalised_reward_is_refused_per_sample_naming_gdpo(verl_091):
    out = verl_091["group_without_gdpo"]
    assert "normalises over the batch or prompt groups" in out["error"] and "GDPO" in out["error"]


def test_gdpo_route_gives_verl_the_raw_components_and_its_advantage(configs, verl_091):
    overrides = adapter.overrides(configs["group"])  # a group-normalised reward: GDPO settings included
    assert "algorithm.adv_estimator=gdpo" in overrides
    out = verl_091["gdpo"]
    assert "error" not in out, out["error"]
    stories = out["stories"]
    rouge = create_reward("rouge_l").score(stories, reference=HUMAN)
    repetition = create_reward("repetition").score(stories)
    assert out["extra"]["weighted/rouge_l"] == pytest.approx(list(rouge), rel=1e-6)
    assert out["extra"]["weighted/repetition"] == pytest.approx(list(repetition), rel=1e-6)
    assert out["scores"] == pytest.approx(list(0.7 * rouge + 0.3 * repetition), rel=1e-6)
    # GDPO by hand: each key z-scored in its group (unbiased std + 1e-6), weighted, whitened over tokens
    uid = np.array(IDS)
    total = np.zeros(len(stories))
    for values, weight in ((rouge, 0.7), (repetition, 0.3)):
        z = np.zeros(len(stories))
        for g in set(IDS):
            v = values[uid == g]
            z[uid == g] = (v - v.mean()) / (v.std(ddof=1) + 1e-6)
        total += weight * z
    tokens = np.repeat(total, out["lengths"])
    whitened = (total - tokens.mean()) / math.sqrt(tokens.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(out["advantages"], whitened, rtol=1e-4, atol=1e-5)


def test_overrides_follow_the_verl_version(configs, tmp_path):
    new = adapter.overrides(configs["repetition"])
    assert new[:2] == ["reward.custom_reward_function.path=pkg://storyrl.integrations.verl",
                       "reward.custom_reward_function.name=compute_score_async"]
    old = adapter.overrides(configs["repetition"], "0.6.1")
    assert old[0] == f"custom_reward_function.path={adapter.__file__}" and old[1].endswith("=compute_score")
    assert adapter.overrides(configs["repetition"], "0.7.0")[0].endswith("=pkg://storyrl.integrations.verl")
    assert not any("gdpo" in o for o in adapter.overrides(configs["group"], gdpo=False))
    with pytest.raises(ValueError, match="GDPO needs verl >= 0.8.0"):
        adapter.overrides(configs["group"], "0.7.1")
    spaced = tmp_path / "my configs" / "r.yaml"
    spaced.parent.mkdir()
    spaced.write_text("reward: repetition\n")
    assert adapter.overrides(spaced)[2].endswith(f"storyrl_config='{spaced}'")


def test_gdpo_settings_and_refusals(configs):
    assert adapter.gdpo_settings(configs["group"]) == {
        "adv_estimator": "gdpo", "gdpo_reward_keys": ["weighted/rouge_l", "weighted/repetition"], "gdpo_reward_weights": [0.7, 0.3]}
    with pytest.raises(ValueError, match="component 'repetition' has normalize: none"):
        adapter.gdpo_settings(configs["mixed"])
    with pytest.raises(ValueError, match="'weighted' reward"):
        adapter.gdpo_settings(configs["dhm"])


def test_verl_09_ignores_the_old_keys_and_has_no_batch_manager(verl_091):
    # verl 0.9 reads reward.custom_reward_function only, and has no batch manager
    assert verl_091["resolve_legacy_keys"]["custom_fn"] is False
    assert verl_091["resolve_batch_manager"]["manager_error"] == "Unknown reward manager: batch"
    out = verl_091["resolve_new_keys"]
    assert out["custom_fn"] is True and out["manager"] == "NaiveRewardManager"


def test_verl_08_through_its_main_ppo_migration(configs, tokenizer_dir):
    overrides = [*adapter.overrides(configs["dhm"], "0.8.0"), WAIT]
    out = run_check("verl_reward.py", verl_job("loop", overrides, tokenizer_dir, migrate=True),
                    framework_path("verl", "0.8.0"))
    assert "error" not in out, out["error"]
    expected, _ = direct(configs["dhm"], out["stories"], reference=HUMAN)
    np.testing.assert_allclose(out["scores"], expected, rtol=1e-6)


def test_verl_06_batch_manager_normalises_over_the_batch(configs, tokenizer_dir):
    overrides = adapter.overrides(configs["group"], "0.6.1")
    assert overrides[-1] == "reward_model.reward_manager=batch" and "compute_score_batch" in overrides[1]
    out = run_check("verl_reward.py", {"mode": "legacy", "samples": samples(),
                                       "overrides": [*overrides, f"actor_rollout_ref.model.path={tokenizer_dir}"]},
                    framework_path("verl", "0.6.1"))
    assert "error" not in out, out["error"]
    assert out["manager"] == "BatchRewardManager"
    tok = chat_tokenizer(STORIES + HUMAN)  # the stories as verl decodes them
    stories = [tok.decode(tok(s, add_special_tokens=False)["input_ids"], skip_special_tokens=True) for s in STORIES]
    expected, _ = direct(configs["group"], stories, reference=HUMAN, story_id=IDS)
    np.testing.assert_allclose(out["scores"], expected, rtol=1e-5, atol=1e-6)
