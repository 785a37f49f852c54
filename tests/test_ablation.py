"""Reward ablations (issue 11 part 4): fixed story files scored with the
model-free repetition metric, a tiny random coherence model and a tiny
CLIPScore; the table recomputed with numpy from scores computed here
directly; reruns that redo nothing; changed variants and metrics refused;
config errors; the CLI; and training-mode runs (the RL orchestration
replaced by fakes that record their calls, and end to end with a tiny
random LLaMA policy)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import storyrl  # noqa: F401  (before transformers: the CPU torchvision fallback)

from tiny_models import albert_tokenizer, save_coherence_model

REPO = Path(__file__).resolve().parents[1]
REPETITION = str(REPO / "configs" / "rewards" / "repetition.yaml")

HUMAN = {
    "s0": "The dog ran to the park. It saw a red car. The sun was hot that day.",
    "s1": "We ate cake at home. The cake was big and sweet. Then we went to sleep.",
    "s2": "They walked by the tree. The sky was blue. A cat sat on the wall.",
    "s3": "We had a party. Everyone came to the park. It was a great day.",
}
#: s1's human story is its reference, not its story field (which is a draft)
REFERENCE_S1 = "We baked a cake. It was big and sweet. We ate it all at home."
STORIES = {
    # every sequence; s3's one sentence is unscorable for repetition and coherence
    "all_dims": {"s0": "The dog ran. The dog ran to the car. The sun was hot.",
                 "s1": "We ate cake. The cake was big. We went to sleep.",
                 "s2": "A cat sat on the wall. The sky was blue. The tree was big.",
                 "s3": "A party."},
    # s1 and s3 missing (failures); "x9" is no sequence of the data: ignored
    "no_R": {"s0": "The car was red. The dog ran to the park. It was hot.",
             "s2": "They walked by the tree. They walked by the tree. They walked by the tree.",
             "x9": "Not in the data. Not at all."},
}


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_clip, images):
    root = tmp_path_factory.mktemp("ablation_assets")
    data = root / "data.jsonl"
    rows = [{"story_id": sid, "story": text, "images": images[k % 3:] + images[: k % 3]}
            for k, (sid, text) in enumerate(HUMAN.items())]
    rows[1]["reference"] = REFERENCE_S1
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = {}
    for name, stories in STORIES.items():
        files[name] = root / f"{name}.json"
        files[name].write_text(json.dumps(stories))
    texts = [*HUMAN.values(), REFERENCE_S1, *(t for s in STORIES.values() for t in s.values())]
    coherence = save_coherence_model(root / "coherence", albert_tokenizer(texts, vocab_size=128), seed=0,
                                     size="small", head_scale=20)
    return {"root": root, "data": data, "files": files, "images": {r["story_id"]: r["images"] for r in rows},
            "metrics": [REPETITION, {"reward": "coherence", "model": coherence, "device": "cpu"},
                        {"reward": "clipscore", "clip_model": tiny_clip, "clip_pretrained": None, "device": "cpu"}]}


def _config(assets, out: Path, **changes) -> dict:
    config = {"output_dir": str(out), "stories": {k: str(v) for k, v in assets["files"].items()},
              "eval": {"data": str(assets["data"]), "metrics": assets["metrics"], "batch_size": 3}}
    config.update(changes)
    return config


def _write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _run(assets, out: Path, only=None, overwrite=False, **changes):
    from storyrl.eval.ablation import AblationConfig, run_ablation

    path = _write(out.parent / f"{out.name}.yaml", _config(assets, out, **changes))
    return run_ablation(AblationConfig.from_yaml(path), progress=False, only=only, overwrite=overwrite)


@pytest.fixture(scope="module")
def ablated(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablation") / "out"
    return out, _run(assets, out)


def _direct_scores(assets, texts: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each metric computed here on the texts, not through the runner's files."""
    from storyrl.eval.scoring import make_metric

    ids = list(texts)
    scores = {}
    for spec in assets["metrics"]:
        metric = make_metric(spec)
        values = metric.score([texts[s] for s in ids], images=[assets["images"][s] for s in ids])
        scores[metric.name] = dict(zip(ids, map(float, values)))
    return scores


def _expected(assets, stories: dict[str, str]) -> dict:
    """The table row by numpy: metric means over finite scores; d_HM over the
    stories whose coherence and repetition are finite on both sides."""
    human_texts = {**HUMAN, "s1": REFERENCE_S1}
    human = _direct_scores(assets, human_texts)
    ids = [s for s in HUMAN if s in stories]
    model = _direct_scores(assets, {s: stories[s] for s in ids})
    dims = ["coherence", "repetition"]
    counted = [s for s in ids if np.isfinite([human[d][s] for d in dims] + [model[d][s] for d in dims]).all()]
    distances = {d: float(np.mean([abs(human[d][s] - model[d][s]) for s in counted])) for d in dims}
    means = {m: float(np.nanmean(np.array(list(v.values())))) for m, v in model.items()}
    return {"stories": len(ids), "failures": 4 - len(ids), "n": len(counted), "unscorable": len(ids) - len(counted),
            "means": means, "distances": distances, "d_hm": float(np.mean(list(distances.values()))),
            "human_means": {m: float(np.nanmean(np.array(list(v.values())))) for m, v in human.items()}}


def test_table_equals_means_and_d_hm_recomputed_with_numpy(assets, ablated):
    _, result = ablated
    assert [v.variant for v in result.variants] == ["all_dims", "no_R"]
    assert result.metrics == ["repetition", "coherence", "clipscore"]
    assert result.dimensions == ["coherence", "repetition"]
    for row in result.variants:
        expected = _expected(assets, STORIES[row.variant])
        assert (row.records, row.stories, row.failures, row.n, row.unscorable) == (
            4, expected["stories"], expected["failures"], expected["n"], expected["unscorable"])
        assert row.means == pytest.approx(expected["means"], rel=1e-6)
        assert row.distances == pytest.approx(expected["distances"], rel=1e-6)
        assert row.d_hm == pytest.approx(expected["d_hm"], rel=1e-6)
        assert result.human.means == pytest.approx(expected["human_means"], rel=1e-6)
    # the cases are real: an unscorable story, missing ones, distances that differ
    assert result.row("all_dims").unscorable == 1 and result.row("no_R").failures == 2
    assert result.row("all_dims").d_hm != pytest.approx(result.row("no_R").d_hm)


def test_csv_markdown_and_png(ablated):
    out, result = ablated
    with (out / "ablation.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["variant", "records", "stories", "failures", "unscorable", "n", "repetition",
                             "coherence", "clipscore", "d_C", "d_R", "d_HM"]
    assert [r["variant"] for r in rows] == ["all_dims", "no_R", "human"]
    for row, variant in zip(rows, result.variants):
        assert float(row["d_HM"]) == variant.d_hm and float(row["d_C"]) == variant.distances["coherence"]
        assert float(row["clipscore"]) == variant.means["clipscore"] and row["failures"] == str(variant.failures)
    assert rows[2]["d_HM"] == "" and float(rows[2]["repetition"]) == result.human.means["repetition"]
    markdown = (out / "ablation.md").read_text()
    assert markdown == result.markdown and f"{result.variants[1].d_hm:.4f}" in markdown
    assert "| no_R " in markdown and " d_C |" in markdown
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.paths == {"csv": out / "ablation.csv", "markdown": out / "ablation.md", "plot": out / "ablation.png"}


class Spy:
    """Counts the stories every metric scores (patched into Reward.score)."""

    def __init__(self, monkeypatch) -> None:
        from storyrl.rewards.base import Reward

        self.scored: list[tuple[str, int]] = []
        original = Reward.score

        def score(reward, stories, **context):
            self.scored.append((reward.name, len(stories)))
            return original(reward, stories, **context)

        monkeypatch.setattr(Reward, "score", score)


def _stamps(out: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and not p.name.startswith("ablation.")}


def test_rerun_scores_nothing_and_rebuilds_the_same_table(assets, ablated, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(ablated[0], out)
    before = _stamps(out)
    spy = Spy(monkeypatch)
    again = _run(assets, out)
    assert spy.scored == []
    assert _stamps(out) == before
    assert again.markdown == ablated[1].markdown


def test_interrupted_scores_resume_and_only_runs_the_chosen_variants(assets, ablated, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(ablated[0], out)
    scores = out / "variants" / "all_dims" / "scores.csv"
    lines = scores.read_text().splitlines(keepends=True)
    scores.write_text("".join(lines[:3]) + lines[3][:5])  # two rows kept, one cut by a kill
    spy = Spy(monkeypatch)
    again = _run(assets, out, only=["all_dims"])
    assert spy.scored == [("repetition", 2), ("coherence", 2), ("clipscore", 2)]  # s2 and s3
    assert [v.variant for v in again.variants] == ["all_dims", "no_R"]  # no_R finished earlier: in the table
    assert again.row("all_dims").d_hm == pytest.approx(ablated[1].row("all_dims").d_hm, rel=1e-6)


def test_a_changed_story_file_is_an_error_and_overwrite_rescores_only_it(assets, ablated, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(ablated[0], out)
    changed = tmp_path / "no_R.json"
    changed.write_text(json.dumps({**STORIES["no_R"], "s1": "We ate. We slept."}))
    stories = {"all_dims": str(assets["files"]["all_dims"]), "no_R": str(changed)}
    spy = Spy(monkeypatch)
    with pytest.raises(ValueError, match=r"^variant no_R changed since it ran \(.*no_R/variant.json\): its story "
                                         r"file .*no_R.json has other content; use --overwrite to redo it"):
        _run(assets, out, stories=stories)
    assert spy.scored == []
    # the same content elsewhere is the same variant
    moved = tmp_path / "moved.json"
    shutil.copy(assets["files"]["no_R"], moved)
    _run(assets, out, stories={**stories, "no_R": str(moved)})
    assert spy.scored == []
    result = _run(assets, out, stories=stories, overwrite=True)
    assert spy.scored == [("repetition", 3), ("coherence", 3), ("clipscore", 3)]
    expected = _expected(assets, json.loads(changed.read_text()))
    assert result.row("no_R").d_hm == pytest.approx(expected["d_hm"], rel=1e-6)
    assert result.row("no_R").failures == 1


def test_changed_metrics_are_an_error_and_overwrite_rescores_everything(assets, ablated, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(ablated[0], out)
    metrics = [{"reward": "repetition", "chunk_size": 3}, *assets["metrics"][1:]]
    eval_ = {**_config(assets, out)["eval"], "metrics": metrics}
    spy = Spy(monkeypatch)
    with pytest.raises(ValueError, match=r"metrics.json: the scores were made with other metrics "
                                         r"\(metrics.repetition.chunk_size: 4 -> 3\); use --overwrite"):
        _run(assets, out, eval=eval_)
    assert spy.scored == []
    _run(assets, out, eval=eval_, overwrite=True)
    totals = {m: sum(n for name, n in spy.scored if name == m) for m in ("repetition", "coherence", "clipscore")}
    assert totals == dict.fromkeys(totals, 4 + 4 + 2)  # the human stories and both variants
    spy.scored.clear()
    _run(assets, out, eval=eval_)  # recorded: the next run is a plain rerun
    assert spy.scored == []


@pytest.mark.parametrize("change, message", [
    ({"stories": {}}, r"give variants \(with train\) or stories"),
    ({"variants": {"a": {}}, "train": {}}, r"give either variants .* or stories .*, not both"),
    ({"stories": {"human": "x.json"}}, r"stories: 'human' names the human stories' row"),
    ({"stories": {"a b": "x.json"}}, r"stories: name 'a b': use letters"),
    ({"train": "configs/rl/x.yaml"}, r"train: fixed story files \(stories\) are not trained"),
    ({"eval": {"data": "d.jsonl", "metrics": ["fluency"]}}, r"eval: metrics\[0\]: 'fluency' is neither a reward "
                                                            r"config file nor a reward"),
    ({"eval": {"data": "d.jsonl", "metrics": [{"reward": "repetition", "colour": 1}]}},
     r"eval: metrics\[0\]: reward 'repetition': .*unknown option 'colour'"),
    ({"eval": {"data": "d.jsonl", "metrics": ["repetition", {"reward": "repetition"}]}},
     r"eval: metrics: 'repetition' is given twice"),
    ({"eval": {"data": "d.jsonl", "metrics": ["repetition"], "dimensions": ["coherence"]}},
     r"eval: dimensions: 'coherence' is not among the metrics"),
    ({"eval": {"data": "d.jsonl", "metrics": ["repetition"], "dimensions": ["fluency"]}},
     r"eval: dimensions: 'fluency' is not a d_HM dimension"),
    ({"eval": {"data": "d.jsonl", "metrics": [{"reward": "clipscore"}]}}, r"eval: metrics: no d_HM dimension"),
    ({"eval": {"data": "d.jsonl", "metrics": ["repetition"], "max_stories": 0}}, r"eval: .*max_stories must be >= 1"),
    ({"eval": {"metrics": ["repetition"]}}, r"eval: missing required option\(s\) 'data'"),
    ({"colour": "red"}, r"unknown option 'colour'"),
])
def test_config_errors_name_the_file_and_the_key(assets, tmp_path, change, message):
    from storyrl.eval.ablation import AblationConfig

    path = _write(tmp_path / "bad.yaml", _config(assets, tmp_path / "out", **change))
    with pytest.raises(ValueError, match=f"^{path}: .*{message}"):
        AblationConfig.from_yaml(path)


def test_a_missing_story_file_or_unknown_variant_fails_before_any_work(assets, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")  # under accelerate launch: every process would write the same files
        with pytest.raises(ValueError, match=r"^storyrl ablate runs as one process"):
            _run(assets, tmp_path / "abl")
    with pytest.raises(ValueError, match=r"abl.yaml: stories.gone: no such story file .*gone.json$"):
        _run(assets, tmp_path / "abl", stories={"gone": str(tmp_path / "gone.json")})
    with pytest.raises(ValueError, match=r"abl.yaml: no variant 'nope'; the variants are all_dims, no_R"):
        _run(assets, tmp_path / "abl", only=["nope"])
    assert not (tmp_path / "abl").exists()


def test_cli_prints_the_table_and_fails_when_no_variant_has_a_story(assets, ablated, tmp_path):
    from storyrl.cli import main

    out = tmp_path / "out"
    shutil.copytree(ablated[0], out)
    path = _write(tmp_path / "abl.yaml", _config(assets, out))
    result = CliRunner().invoke(main, ["ablate", "--config", str(path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert ablated[1].markdown in result.output and f"plot: {out / 'ablation.png'}" in result.output

    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"elsewhere": "A story of no sequence here. Really."}))
    path = _write(tmp_path / "empty.yaml", _config(assets, tmp_path / "empty", stories={"e": str(empty)}))
    result = CliRunner().invoke(main, ["ablate", "--config", str(path), "--quiet"])
    assert result.exit_code == 1 and result.output.rstrip().endswith("Error: no variant produced a story (see the table)")

    path = _write(tmp_path / "bad.yaml", _config(assets, out, stories={}))
    for args in (["--config", str(path)], ["--config", str(_write(tmp_path / "ok.yaml", _config(assets, out))),
                                           "--only", "nope"]):
        result = CliRunner().invoke(main, ["ablate", *args, "--quiet"])
        assert result.exit_code == 1 and result.output.startswith("Error: ") and "Traceback" not in result.output
        assert result.output.count("\n") == 1, result.output


@pytest.mark.parametrize("name, variants", [
    ("story_files", ["dhm_all", "dhm_no_G", "dhm_no_C", "dhm_no_R"]),
    ("dhm_dimensions", ["dhm_all", "dhm_no_G", "dhm_no_C", "dhm_no_R", "weighted_GCR"]),
])
def test_shipped_configs_load(tmp_path, monkeypatch, name, variants):
    """Every variant's RL config is validated on loading: run where the
    configs' relative paths resolve (configs/, the training data file)."""
    from storyrl.eval.ablation import AblationConfig, plan_variants

    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "data" / "vist").mkdir(parents=True)
    (tmp_path / "data" / "vist" / "train.story-in-sequence.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    config = AblationConfig.from_yaml(f"configs/ablations/{name}.yaml")
    assert config.eval.dims() == ["groovist", "coherence", "repetition"]
    assert [m.name for m in map(_metric_of(config), config.eval.metrics)] == [
        "groovist", "coherence", "repetition", "clipscore", "rovist_vg"]
    assert list(config.variants or config.stories) == variants
    if config.variants:
        planned = {v.name: v.train_options for v in plan_variants(config)}
        dims = {n: [r.get("dimensions") for r in o["rewards"] if isinstance(r, dict) and r["reward"] == "dhm"]
                for n, o in planned.items()}
        assert dims == {"dhm_all": [["grounding", "coherence", "repetition"]], "dhm_no_G": [["coherence", "repetition"]],
                        "dhm_no_C": [["grounding", "repetition"]], "dhm_no_R": [["grounding", "coherence"]],
                        "weighted_GCR": []}
        assert planned["weighted_GCR"]["reward_weights"] == [1.0, 1.0, 1.0]
        # the same training otherwise
        assert len({json.dumps({k: v for k, v in o.items() if "reward" not in k}, sort_keys=True)
                    for o in planned.values()}) == 1


def _metric_of(config):
    from storyrl.eval.scoring import make_metric

    return lambda spec: make_metric(spec, config.eval.image_root)


# -- training mode: the RL orchestration replaced by fakes ---------------------------------------

#: What each fake policy writes: its variant's story for a sequence (None: the generation failed).
FAKE_STORIES = {
    "rep": lambda sid: "The dog ran. The dog ran. The dog ran.",
    "mix": lambda sid: None if sid == "s2" else HUMAN[sid].replace("The", "A"),
}


class FakeRL:
    """``train`` and ``generate_stories`` of storyrl.training.storyteller.rl standing in
    for the real ones: they record their calls; train writes ``final/`` (and
    a checkpoint first; ``fail`` makes it die after the checkpoint, as a kill
    would); generation writes each variant's FAKE_STORIES."""

    def __init__(self, monkeypatch, fail: bool = False, fail_generation_after: int | None = None) -> None:
        import storyrl.training.storyteller.rl.policy as policy
        import storyrl.training.storyteller.rl.train as train

        self.trained: list[tuple[str, list, bool]] = []
        self.generated: list[tuple[str, list[str], int]] = []

        def fake_train(config, resume=False, progress=True):
            out = Path(config.output_dir)
            self.trained.append((out.parent.name, config, resume))
            (out / "checkpoint-1").mkdir(parents=True, exist_ok=True)
            if fail:
                raise KeyboardInterrupt
            (out / "final").mkdir()
            (out / "final" / "variant").write_text(out.parent.name)

        def fake_generate(config, policy_dir, records, batch_size=8):
            if fail_generation_after is not None and len(self.generated) >= fail_generation_after:
                raise KeyboardInterrupt
            name = (Path(policy_dir) / "variant").read_text()
            self.generated.append((name, [r.story_id for r in records], batch_size))
            assert Path(policy_dir) == Path(config.output_dir) / "final"
            return {r.story_id: FAKE_STORIES[name](r.story_id) for r in records}

        monkeypatch.setattr(train, "train", fake_train)
        monkeypatch.setattr(policy, "generate_stories", fake_generate)


def _train_config(assets, out: Path, **changes) -> dict:
    base = {"model": "tiny", "policy": "causal_lm", "data": str(assets["data"]), "rewards": ["repetition"],
            "max_steps": 2, "grpo": {"learning_rate": 1e-5, "max_completion_length": 8, "num_generations": 2}}
    config = {"output_dir": str(out), "train": base,
              "variants": {"rep": {}, "mix": {"rewards": ["repetition", {"reward": "dhm", "dimensions": ["repetition"]}],
                                              "reward_weights": [1.0, 0.5]}},
              "eval": {"data": str(assets["data"]), "metrics": [REPETITION], "save_every": 3,
                       "generation_batch_size": 2}}
    config.update(changes)
    return config


def _run_training(assets, out: Path, only=None, overwrite=False, **changes):
    from storyrl.eval.ablation import AblationConfig, run_ablation

    path = _write(out.parent / f"{out.name}.yaml", _train_config(assets, out, **changes))
    return run_ablation(AblationConfig.from_yaml(path), progress=False, only=only, overwrite=overwrite)


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "out"
    with pytest.MonkeyPatch.context() as patch:
        fake = FakeRL(patch)
        result = _run_training(assets, out)
    return out, result, fake


def test_each_variant_trains_the_same_config_with_its_rewards_then_generates(assets, trained):
    out, result, fake = trained
    assert [(name, resume) for name, _, resume in fake.trained] == [("rep", False), ("mix", False)]
    rep, mix = (config for _, config, _ in fake.trained)
    assert rep.output_dir == str(out / "variants" / "rep" / "train")
    assert (rep.rewards, rep.reward_weights) == (["repetition"], None)
    assert mix.rewards == ["repetition", {"reward": "dhm", "dimensions": ["repetition"]}]
    assert mix.reward_weights == [1.0, 0.5] and mix.grpo.reward_weights == [1.0, 0.5]
    for config in (rep, mix):  # everything else is the base config
        assert (config.model, config.max_steps, config.grpo.learning_rate, config.grpo.num_generations) == (
            "tiny", 2, 1e-5, 2)
    # save_every 3: two generate_stories calls per variant (one policy load each), batch size 2
    assert fake.generated == [("rep", ["s0", "s1", "s2"], 2), ("rep", ["s3"], 2),
                              ("mix", ["s0", "s1", "s2"], 2), ("mix", ["s3"], 2)]
    stories = json.loads((out / "variants" / "mix" / "stories.json").read_text())
    meta = json.loads((out / "variants" / "mix" / "stories.meta.json").read_text())
    assert stories == {sid: FAKE_STORIES["mix"](sid) for sid in ("s0", "s1", "s3")}
    assert meta["complete"] is True and meta["generator"] == "rl_policy" and list(meta["failures"]) == ["s2"]
    assert meta["options"]["policy"] == str(out / "variants" / "mix" / "train" / "final")
    assert meta["inputs"]["variant"] == "mix"


def test_training_mode_table_equals_numpy(assets, trained):
    from storyrl.rewards import create_reward

    repetition = create_reward("repetition")
    human = {sid: float(v) for sid, v in zip(HUMAN, repetition.score([HUMAN["s0"], REFERENCE_S1, *list(HUMAN.values())[2:]]))}
    for row in trained[1].variants:
        ids = [sid for sid in HUMAN if FAKE_STORIES[row.variant](sid) is not None]
        model = dict(zip(ids, map(float, repetition.score([FAKE_STORIES[row.variant](s) for s in ids]))))
        counted = [s for s in ids if np.isfinite([human[s], model[s]]).all()]
        d = float(np.mean([abs(human[s] - model[s]) for s in counted]))
        assert (row.stories, row.failures, row.n) == (len(ids), 4 - len(ids), len(counted))
        assert row.means["repetition"] == pytest.approx(float(np.nanmean(list(model.values()))), rel=1e-12)
        assert row.distances == pytest.approx({"repetition": d}, rel=1e-12) and row.d_hm == pytest.approx(d, rel=1e-12)
    assert trained[1].row("mix").failures == 1


def test_rerun_trains_generates_and_scores_nothing(assets, trained, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(trained[0], out)
    before = _stamps(out)
    fake, spy = FakeRL(monkeypatch), Spy(monkeypatch)
    again = _run_training(assets, out)
    assert (fake.trained, fake.generated, spy.scored) == ([], [], [])
    assert _stamps(out) == before and again.markdown == trained[1].markdown


def test_interrupted_training_and_generation_continue(assets, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fake = FakeRL(monkeypatch, fail=True)
    with pytest.raises(KeyboardInterrupt):
        _run_training(assets, out, only=["rep"])
    assert [(n, r) for n, _, r in fake.trained] == [("rep", False)]
    fake = FakeRL(monkeypatch, fail_generation_after=1)  # dies after the first saved part of the stories
    with pytest.raises(KeyboardInterrupt):
        _run_training(assets, out, only=["rep"])
    assert [(n, r) for n, _, r in fake.trained] == [("rep", True)]  # resumed from its checkpoint
    fake = FakeRL(monkeypatch)
    result = _run_training(assets, out, only=["rep"])
    assert fake.trained == [] and fake.generated == [("rep", ["s3"], 2)]
    assert [v.variant for v in result.variants] == ["rep"]  # mix never ran: not in the table


def test_a_changed_variant_is_an_error_and_overwrite_retrains_only_it(assets, trained, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(trained[0], out)
    variants = _train_config(assets, out)["variants"]
    variants["mix"]["reward_weights"] = [1.0, 0.25]
    fake, spy = FakeRL(monkeypatch), Spy(monkeypatch)
    with pytest.raises(ValueError, match=r"^variant mix changed since it ran \(.*mix/variant.json\): "
                                         r"train.reward_weights\[1\]: 0.5 -> 0.25; use --overwrite to redo it"):
        _run_training(assets, out, variants=variants)
    assert (fake.trained, fake.generated, spy.scored) == ([], [], [])
    _run_training(assets, out, variants=variants, overwrite=True)
    assert [(n, r) for n, _, r in fake.trained] == [("mix", False)] and fake.trained[0][1].reward_weights == [1.0, 0.25]
    assert [n for n, _, _ in fake.generated] == ["mix", "mix"]
    # a change of the shared training changes every variant
    base = {**_train_config(assets, out)["train"], "max_steps": 3}
    with pytest.raises(ValueError, match=r"^variant rep changed since it ran .*: train.max_steps: 2 -> 3;"):
        _run_training(assets, out, variants=variants, train=base)


@pytest.mark.parametrize("change, message", [
    ({"variants": {"a": {"learning_rate": 1.0}}}, r"variants.a: 'learning_rate' is not a reward option"),
    ({"variants": {"a": {"rewards": ["fluency"]}}}, r"variants.a: .*rewards\[0\]: .*fluency"),
    ({"variants": {"a": {"reward_weights": [1.0, 2.0]}}}, r"variants.a: .*reward_weights: 2 weights for 1 rewards"),
    ({"train": None}, r"variants: give train"),
    ({"train": {"model": "tiny", "data": "nowhere.jsonl", "rewards": ["repetition"]}},
     r"AblationConfig: train \(every variant\): RLConfig: data: no such file nowhere.jsonl$"),
    ({"train": "configs/rl/nope.yaml"}, r"train: no such RL config file configs/rl/nope.yaml"),
])
def test_training_config_errors_name_the_file_and_the_key(assets, tmp_path, change, message):
    from storyrl.eval.ablation import AblationConfig

    path = _write(tmp_path / "bad.yaml", _train_config(assets, tmp_path / "out", **change))
    with pytest.raises(ValueError, match=f"^{path}: .*{message}"):
        AblationConfig.from_yaml(path)


# -- training mode end to end: a tiny random LLaMA policy, one GRPO step per variant ------------------


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny random LLaMA and a chat tokenizer whose words all end in a
    period, saved: whatever the random policy writes has sentences, so that
    repetition scores its stories (a random model writes no periods)."""
    from tiny_models import CHAT_TEMPLATE, CHAT_TEMPLATE_WORDS, tiny_llama, vlm_tokenizer

    directory = tmp_path_factory.mktemp("policy")
    words = "dog. cat. sun. ran. sat. ate. cake. hot. park. tree. sky. car. red. big. we. they."
    tokenizer = vlm_tokenizer([words, CHAT_TEMPLATE_WORDS], image_token=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_llama(tokenizer, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def _e2e_config(assets, policy_dir, out: Path) -> dict:
    base = {"model": policy_dir, "policy": "causal_lm", "data": str(assets["data"]), "rewards": ["repetition"],
            "max_steps": 1, "grpo": {"per_device_train_batch_size": 2, "num_generations": 2,
                                     "max_completion_length": 12, "logging_steps": 1, "save_strategy": "no"}}
    return {"output_dir": str(out), "train": base,
            "variants": {"rep": {}, "rep_dhm": {"rewards": ["repetition", {"reward": "dhm", "dimensions": ["repetition"]}],
                                                "reward_weights": [1.0, 0.5]}},
            "eval": {"data": str(assets["data"]), "metrics": [REPETITION], "generation_batch_size": 4}}


def test_training_mode_end_to_end_with_a_tiny_policy(assets, policy_dir, tmp_path, monkeypatch):
    import storyrl.training.storyteller.rl.train as rl_train
    from storyrl.data import load_stories
    from storyrl.eval.ablation import AblationConfig, run_ablation
    from storyrl.rewards import create_reward
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import generate_stories

    out = tmp_path / "out"
    path = _write(tmp_path / "abl.yaml", _e2e_config(assets, policy_dir, out))
    result = run_ablation(AblationConfig.from_yaml(path), progress=False)
    records = load_stories(assets["data"])
    repetition = create_reward("repetition")
    human = [r.reference or r.story for r in records]
    human_scores = np.array(repetition.score(human), dtype=float)
    for row in result.variants:
        train_dir = out / "variants" / row.variant / "train"
        saved = RLConfig.from_yaml(train_dir / "rl_config.yaml")  # what was trained
        assert saved.rewards == (["repetition"] if row.variant == "rep" else
                                 ["repetition", {"reward": "dhm", "dimensions": ["repetition"]}])
        logged = set().union(*(json.loads(line) for line in (train_dir / "history.jsonl").read_text().splitlines()))
        assert ("rewards/dhm/mean" in logged) == (row.variant == "rep_dhm")
        # the story file holds the trained policy's greedy stories, generated here again
        stories = json.loads((out / "variants" / row.variant / "stories.json").read_text())
        again = generate_stories(saved, str(train_dir / "final"), records, batch_size=4)
        assert stories == again and len(stories) == 4
        model_scores = np.array(repetition.score([stories[r.story_id] for r in records]), dtype=float)
        ok = np.isfinite(model_scores) & np.isfinite(human_scores)
        assert (row.stories, row.failures, row.n) == (4, 0, int(ok.sum()))
        assert row.d_hm == pytest.approx(float(np.mean(np.abs(model_scores - human_scores)[ok])), rel=1e-12)
        assert row.means["repetition"] == pytest.approx(float(np.nanmean(model_scores)), rel=1e-12)
    assert any(row.n for row in result.variants), result.markdown  # the comparison is not only NaN == NaN

    trained = []
    monkeypatch.setattr(rl_train, "train", lambda *a, **k: trained.append(a))
    spy = Spy(monkeypatch)
    assert run_ablation(AblationConfig.from_yaml(path), progress=False).markdown == result.markdown
    assert trained == [] and spy.scored == []
