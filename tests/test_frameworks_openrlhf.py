"""storyrl's OpenRLHF adapter and ``storyrl serve`` through released
OpenRLHF's own reward client code (see tests/frameworks.py): 0.10.2 and
0.11.2's ``SingleTurnAgentExecutor`` (reward file or URL, one sample per
call, queries decoded with special tokens) and 0.8.3's HTTP client. The
expected values are storyrl's rewards computed here on the same stories."""

from __future__ import annotations

import pytest

from storyrl.integrations import openrlhf as adapter
from storyrl.integrations.server import create_app, run_in_thread
from storyrl.rewards import load_reward_config
from tests.frameworks import framework_path, run_check
from tests.tiny_models import chat_tokenizer

STORIES = [
    "The family went to the beach . The kids built a castle . The sun was warm .",
    "We went to the park . We went to the park . We went to the park .",
    "A dog ran on the sand . It found a red ball . Everyone laughed .",
]
HUMAN = [
    "The family spent a day at the beach . The kids built a sand castle .",
    "A day at the park . We played all day .",
    "A dog played on the beach . It found a red ball .",
]
PROMPTS = ["Tell a story : beach", "Tell a story : park", "Tell a story : dog"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("openrlhf_tokenizer")
    tok = chat_tokenizer(STORIES + HUMAN + PROMPTS)
    tok.add_special_tokens({"eos_token": "</s>"})  # one of storyrl's END_MARKERS, as LLaMA's
    tok.save_pretrained(directory)
    return tok, directory


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("openrlhf_configs")
    (d / "dhm.yaml").write_text("reward: dhm\ndimensions: [repetition]\n")
    (d / "rouge.yaml").write_text("reward: rouge_l\n")
    (d / "group.yaml").write_text("reward: weighted\ncomponents:\n  - {reward: rouge_l, weight: 0.5}\n"
                                  "  - {reward: repetition, weight: 1.0, normalize: group}\n")
    return d


def decoded(tok, stories):
    return [tok.decode(tok(s, add_special_tokens=False)["input_ids"], skip_special_tokens=True) for s in stories]


def executor_job(remote, tokenizer_dir, labels):
    return {"mode": "executor", "remote_rm_url": remote, "tokenizer": str(tokenizer_dir), "stories": STORIES,
            "prompts": PROMPTS, "labels": labels}


@pytest.mark.parametrize("version", ["0.10.2", "0.11.2"])
def test_reward_file_in_openrlhf_executor(version, tokenizer, configs):
    tok, directory = tokenizer
    out = run_check("openrlhf_reward.py", executor_job(adapter.__file__, directory, HUMAN),
                    framework_path("openrlhf", version), env={"STORYRL_REWARD_CONFIG": str(configs / "dhm.yaml")})
    assert out["openrlhf"] == version and out["file_loaded"]
    reward = load_reward_config(configs / "dhm.yaml")
    expected = reward.score(decoded(tok, STORIES), reference=HUMAN)
    repetition = reward.last_components["repetition"]
    for i, sample in enumerate(out["outputs"]):  # one call per sample: tensors of one value
        assert sample["reward"] == pytest.approx([expected[i]], rel=1e-6)
        assert sample["scores"] == pytest.approx([expected[i]], rel=1e-6)
        assert sample["extra_logs"]["unscorable"] == [0.0]
        assert sample["extra_logs"]["dhm/repetition"] == pytest.approx([repetition[i]], rel=1e-6)


@pytest.mark.parametrize(("config", "labels", "says"), [
    # without --data.label_key every label is "": refused (and logged) rather than the fallback for every sample
    ("rouge.yaml", [""] * 3, "--data.label_key"),
    # one sample per call: a group-normalised component would vanish
    ("group.yaml", HUMAN, "group_norm"),
])
def test_refused_rewards_give_no_reward_and_say_why(tokenizer, configs, config, labels, says):
    # OpenRLHF 0.11 logs a failed reward call at INFO and leaves the sample's reward unset; storyrl logs the reason
    _, directory = tokenizer
    out = run_check("openrlhf_reward.py", executor_job(adapter.__file__, directory, labels),
                    framework_path("openrlhf", "0.11.2"), env={"STORYRL_REWARD_CONFIG": str(configs / config)},
                    capture_stderr=True)
    assert all(sample["reward"] is None for sample in out["outputs"])
    assert says in out["stderr"]


def test_server_through_openrlhf_http_clients(tokenizer, configs):
    tok, directory = tokenizer
    reward = load_reward_config(configs / "dhm.yaml").setup()
    stories = decoded(tok, STORIES)
    expected = reward.score(stories, reference=HUMAN)
    with run_in_thread(create_app(reward)) as url:
        endpoint = f"{url}/get_reward"
        out = run_check("openrlhf_reward.py", executor_job(endpoint, directory, HUMAN),
                        framework_path("openrlhf", "0.11.2"))
        assert not out["file_loaded"]
        # the server answers lists: OpenRLHF keeps the one-value list of each request
        assert [s["reward"] for s in out["outputs"]] == [pytest.approx([v], rel=1e-6) for v in expected]
        # 0.8.3's client posts a whole batch (prompt + response + EOS, as it decodes them)
        queries = [p + " " + s + " </s>" for p, s in zip(PROMPTS, stories)]
        old = run_check("openrlhf_reward.py", {"mode": "request", "url": endpoint, "queries": queries,
                                               "prompts": PROMPTS, "labels": HUMAN},
                        framework_path("openrlhf", "0.8.3"))
        assert old["openrlhf"] == "0.8.3"
        assert old["answer"]["rewards"] == pytest.approx(list(expected), rel=1e-6)
        assert old["answer"]["extra_logs"]["unscorable"] == [0.0, 0.0, 0.0]
