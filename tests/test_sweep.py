"""Prompting sweeps (issue 10 part 2): a sweep end to end with two tiny
random-weight VLMs (LLaVA-NeXT and BLIP-2), two settings and two prompts,
scored with repetition and a tiny coherence model; d_HM recomputed by hand
from the score files; resume; shard merging; config errors; the CLI."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import storyrl  # noqa: F401  (before transformers: the CPU torchvision fallback)

from tiny_models import albert_tokenizer, save_coherence_model, save_tiny_vlm, write_images

HUMAN = [
    "The dog ran to the park. It saw a red car. The sun was hot that day.",
    "We ate cake at home. The cake was big and sweet. Then we went to sleep.",
    "They walked by the tree. The sky was blue. A cat sat on the wall.",
    "We had a party. Everyone came to the park. It was a great day.",
]
# Whitespace tokens that carry a period: whatever the random VLM emits, its
# stories have sentences, so that most generated stories are scorable.
VLM_WORDS = ["dog. cat. sun. ran. sat. ate. cake. hot. park. tree. sky. car. red. big. we. they."]
REPETITION = str(Path(__file__).resolve().parents[1] / "configs" / "rewards" / "repetition.yaml")
MODELS = ("llava_next", "blip2")
SETTINGS = ("visual", "prev_sentence")
PROMPTS = ("P1", "P2")


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep_assets")
    images = [str(p) for p in write_images(root / "img", 3, size=(32, 32))]
    data = root / "data.jsonl"
    rows = [{"story_id": f"s{k}", "story": s, "images": images[k % 3:] + images[: k % 3]} for k, s in enumerate(HUMAN)]
    rows[3]["images"] = [images[0], str(root / "missing.png"), images[2]]  # this story's generation fails
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = albert_tokenizer([*HUMAN, *VLM_WORDS], vocab_size=128)
    return {
        "root": root, "data": data,
        "vlms": {family: save_tiny_vlm(root / family, family, VLM_WORDS) for family in MODELS},
        "coherence": save_coherence_model(root / "coherence", tokenizer, seed=0, size="tiny", head_scale=20),
    }


def _config(assets, out: Path, **changes) -> dict:
    config = {
        "data": str(assets["data"]),
        "output_dir": str(out),
        "models": [{"name": family, "options": {"model": assets["vlms"][family]}} for family in MODELS],
        "settings": list(SETTINGS),
        "prompts": list(PROMPTS),
        "generation": {"device": "cpu", "max_new_tokens": 12, "batch_size": 2, "sequence_image_size": "12x12"},
        "rewards": {"coherence": {"model": assets["coherence"], "device": "cpu"},
                    "repetition": REPETITION},
    }
    config.update(changes)
    return config


def _write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def _run(assets, out: Path, **changes):
    from storyrl.eval.sweep import SweepConfig, run_sweep

    path = _write(out.parent / f"{out.name}.yaml", _config(assets, out, **changes))
    return run_sweep(SweepConfig.from_yaml(path), progress=False)


class Calls:
    """Counts the records each generation call gets (patched in)."""

    def __init__(self, monkeypatch, fail_after: int | None = None) -> None:
        from storyrl.generators.prompting import PromptingGenerator

        self.ids: list[str] = []
        original = getattr(PromptingGenerator._generate_batch, "unpatched", PromptingGenerator._generate_batch)

        def counting(generator, records):
            if fail_after is not None and len(self.ids) >= fail_after:
                raise KeyboardInterrupt  # not an Exception: ends the run as a kill would
            self.ids += [r.story_id for r in records]
            return original(generator, records)

        counting.unpatched = original
        monkeypatch.setattr(PromptingGenerator, "_generate_batch", counting)


@pytest.fixture(scope="module")
def swept(assets, tmp_path_factory):
    """The sweep, with a log of model loads and releases."""
    import storyrl.models
    import storyrl.models.coherence
    import storyrl.models.vlm

    out = tmp_path_factory.mktemp("sweep") / "out"
    events = []
    with pytest.MonkeyPatch.context() as patch:
        for module, name, event in ((storyrl.models.vlm, "_load", "vlm"), (storyrl.models, "release_models", "release"),
                                    (storyrl.models.coherence, "load_coherence_model", "coherence")):
            def logged(*args, _original=getattr(module, name), _event=event, **kwargs):
                events.append(f"{_event} {Path(args[0]).name}" if args else _event)
                return _original(*args, **kwargs)

            patch.setattr(module, name, logged)
        result = _run(assets, out)
    return out, result, events


def _scores(path: Path) -> dict[str, dict[str, float]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return {r["story_id"]: {k: float(v) if v else math.nan for k, v in r.items() if k != "story_id"}
                for r in csv.DictReader(fh)}


def _hand_dhm(human: dict, model: dict) -> tuple[int, dict[str, float], float]:
    """d_HM as the paper defines it, from the two CSVs' rows: a story counts
    when all its scores are finite on both sides."""
    ids = [sid for sid in human if sid in model
           and all(np.isfinite([human[sid][m], model[sid][m]]).all() for m in ("coherence", "repetition"))]
    dist = {m: float(np.mean([abs(human[s][m] - model[s][m]) for s in ids])) if ids else math.nan
            for m in ("coherence", "repetition")}
    return len(ids), dist, float(np.mean(list(dist.values()))) if ids else math.nan


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, abs=1e-12)


def test_sweep_table_equals_d_hm_recomputed_from_the_score_files(swept):
    out, result, _ = swept
    cells = {(c.model, c.setting, c.prompt): c for c in result.cells}
    assert list(cells) == [(m, s, p) for m in MODELS for s in SETTINGS for p in PROMPTS]
    human = _scores(out / "human_scores.csv")
    assert list(human) == ["s0", "s1", "s2", "s3"] and all(math.isfinite(v) for r in human.values() for v in r.values())
    for (model, setting, prompt), cell in cells.items():
        directory = out / "cells" / model / setting / prompt
        stories = json.loads((directory / "stories.json").read_text())
        meta = json.loads((directory / "stories.meta.json").read_text())
        assert meta["complete"] is True and meta["options"]["setting"] == setting and meta["options"]["prompt"] == prompt
        assert list(meta["failures"]) == ["s3"] and "s3" not in stories  # the missing image
        scores = _scores(directory / "scores.csv")
        assert list(scores) == list(stories) == ["s0", "s1", "s2"]
        n, dist, d_hm = _hand_dhm(human, scores)
        assert (cell.records, cell.stories, cell.failures, cell.n, cell.unscorable) == (4, 3, 1, n, 3 - n)
        assert _same(cell.distances["coherence"], dist["coherence"])
        assert _same(cell.distances["repetition"], dist["repetition"])
        assert _same(cell.d_hm, d_hm)
    # Some tiny LLaVA-NeXT stories are scorable, so the comparison above is
    # not only NaN == NaN; the others test the exclusion of unscorable stories.
    assert all(cells[("llava_next", "prev_sentence", p)].n == 3 for p in PROMPTS), result.markdown
    assert cells[("blip2", "visual", "P1")].n == 0, result.markdown
    means = {(m.model, m.setting): m for m in result.means}
    assert list(means) == [(m, s) for m in MODELS for s in SETTINGS]
    for (model, setting), mean in means.items():
        group = [cells[(model, setting, p)] for p in PROMPTS if math.isfinite(cells[(model, setting, p)].d_hm)]
        assert mean.prompts == len(group)
        assert _same(mean.d_hm, float(np.mean([c.d_hm for c in group])) if group else math.nan)
        assert _same(mean.distances["coherence"],
                     float(np.mean([c.distances["coherence"] for c in group])) if group else math.nan)
        assert mean.failures == len(PROMPTS)


def test_each_model_loads_once_and_is_released_before_the_next(swept):
    assert swept[2] == ["vlm llava_next", "release", "vlm blip2", "release", "coherence coherence"]


def test_sweep_writes_csv_markdown_and_plot(swept):
    out, result, _ = swept
    with (out / "dhm.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(result.cells) + len(result.means)
    assert [(r["model"], r["setting"], r["prompt"]) for r in rows[:len(result.cells)]] == [
        (c.model, c.setting, c.prompt) for c in result.cells]
    k, cell = next((k, c) for k, c in enumerate(result.cells) if c.n)
    assert (rows[k]["n"], rows[k]["failures"], rows[k]["unscorable"]) == (str(cell.n), "1", str(cell.unscorable))
    assert float(rows[k]["d_hm"]) == pytest.approx(cell.d_hm)
    assert float(rows[k]["coherence"]) == pytest.approx(cell.distances["coherence"])
    assert rows[0]["d_hm"] == "" and math.isnan(result.cells[0].d_hm)  # NaN is an empty cell
    assert [r["prompt"] for r in rows[-len(result.means):]] == ["mean"] * len(result.means)
    markdown = (out / "dhm.md").read_text()
    assert markdown == result.markdown and "| llava_next | prev_sentence" in markdown and f"{cell.d_hm:.4f}" in markdown
    assert "## d_HM, mean over prompts" in markdown and "## d_HM per cell" in markdown
    assert (out / "dhm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.paths == {"csv": out / "dhm.csv", "markdown": out / "dhm.md", "plot": out / "dhm.png"}


def test_rerun_redoes_nothing_and_an_interrupted_cell_resumes(assets, swept, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(swept[0], out)
    def stamps():
        return {p: p.stat().st_mtime_ns for p in [*(out / "cells").rglob("*"), out / "human_scores.csv"] if p.is_file()}

    before = stamps()
    calls = Calls(monkeypatch)
    again = _run(assets, out)
    assert calls.ids == []
    assert stamps() == before
    assert [c.d_hm for c in again.cells] == pytest.approx([c.d_hm for c in swept[1].cells], nan_ok=True)

    # A fresh one-cell sweep killed during generation (after the first batch
    # of two stories) continues where it stopped.
    fresh, one = tmp_path / "fresh", {"settings": ["prev_sentence"], "prompts": ["P2"]}
    Calls(monkeypatch, fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        _run(assets, fresh, **one)
    cell = fresh / "cells" / "llava_next" / "prev_sentence" / "P2"
    assert list(json.loads((cell / "stories.json").read_text())) == ["s0", "s1"]
    assert json.loads((cell / "stories.meta.json").read_text())["complete"] is False
    calls = Calls(monkeypatch)
    resumed = _run(assets, fresh, **one)
    # s2 and s3 in the interrupted cell (their batch fails on s3 and is
    # retried record by record), then all of BLIP-2's
    assert calls.ids == ["s2", "s3", "s2", "s3", "s0", "s1", "s2", "s3", "s2", "s3"]
    assert (cell / "stories.json").read_text() == (swept[0] / "cells" / "llava_next" / "prev_sentence" / "P2"
                                                    / "stories.json").read_text()
    expected = [c.d_hm for c in swept[1].cells if (c.setting, c.prompt) == ("prev_sentence", "P2")]
    assert [c.d_hm for c in resumed.cells] == pytest.approx(expected, nan_ok=True)


def test_a_finished_cell_made_with_other_options_is_an_error_not_reused(assets, swept, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(swept[0], out)
    calls = Calls(monkeypatch)
    generation = {**_config(assets, out)["generation"], "max_new_tokens": 13}
    cell = out / "cells" / "llava_next" / "visual" / "P1"
    with pytest.raises(ValueError, match=f"^{cell}/stories.meta.json: the stories were generated with max_new_tokens=12, "
                                         f"this run has max_new_tokens=13; use another output_dir, or delete {cell}"):
        _run(assets, out, generation=generation)
    assert calls.ids == []
    _run(assets, out, generation={**generation, "max_new_tokens": 12, "batch_size": 3})  # batch size: runtime only
    assert calls.ids == []


def test_scores_of_an_interrupted_cell_are_resumed(assets, swept, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(swept[0], out)
    scores = out / "cells" / "llava_next" / "prev_sentence" / "P2" / "scores.csv"
    lines = scores.read_text().splitlines(keepends=True)
    before = _scores(scores)
    scores.write_text("".join(lines[:2]) + lines[2][:6])  # one row kept, one cut by a kill
    from storyrl.rewards.repetition import Repetition

    scored = []
    original = Repetition.score

    def counting(self, texts, **context):
        scored.extend(texts)
        return original(self, texts, **context)

    monkeypatch.setattr(Repetition, "score", counting)
    again = _run(assets, out)
    stories = json.loads((scores.parent / "stories.json").read_text())
    assert scored == [stories["s1"], stories["s2"]]
    after = _scores(scores)
    assert list(after) == ["s0", "s1", "s2"] and after["s0"] == before["s0"]
    # (scored in another batch, coherence may differ in the last float bits)
    assert all(after[k] == pytest.approx(before[k], rel=1e-5) for k in ("s1", "s2"))
    assert [c.d_hm for c in again.cells] == pytest.approx([c.d_hm for c in swept[1].cells], nan_ok=True, rel=1e-5)


def test_shards_merge_into_the_cell_in_record_order(tmp_path):
    from storyrl.data import StoryRecord
    from storyrl.eval.sweep import merge_shards, shard_path

    records = [StoryRecord(f"s{k}", "") for k in range(5)]
    out = tmp_path / "stories.json"
    shards = [shard_path(out, rank, 2) for rank in range(2)]
    assert [s.name for s in shards] == ["stories.rank0-of-2.json", "stories.rank1-of-2.json"]
    parts = [({"s0": "zero", "s4": "four"}, {"s2": "ValueError: bad image"}), ({"s1": "one", "s3": "three"}, {})]
    for shard, (stories, failures) in zip(shards, parts):
        shard.write_text(json.dumps(stories))
        meta = {"generator": "prompting", "options": {"setting": "visual"}, "complete": True, "failures": failures}
        shard.with_name(shard.stem + ".meta.json").write_text(json.dumps(meta))
    meta = merge_shards(out, shards, records)
    assert list(json.loads(out.read_text()).items()) == [("s0", "zero"), ("s1", "one"), ("s3", "three"), ("s4", "four")]
    saved = json.loads((tmp_path / "stories.meta.json").read_text())
    assert saved == meta and meta["complete"] is True and meta["shards"] == 2
    assert meta["counts"] == {"records": 5, "stories": 4, "failures": 1} and meta["failures"] == {"s2": "ValueError: bad image"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories.json", "stories.meta.json"]
    # the digest is the merged file's, so the next sweep reuses the cell
    from storyrl.generators.runs import pair_is_whole, text_sha256

    assert meta["stories_sha256"] == text_sha256(out.read_text()) and pair_is_whole(meta, out.read_text())


@pytest.mark.parametrize("case", ["incomplete", "missing", "twice"])
def test_shards_that_do_not_cover_the_records_exactly_are_refused(tmp_path, case):
    from storyrl.data import StoryRecord
    from storyrl.eval.sweep import merge_shards, shard_path

    records = [StoryRecord(f"s{k}", "") for k in range(3)]
    out = tmp_path / "stories.json"
    shards = [shard_path(out, rank, 2) for rank in range(2)]
    parts = [{"s0": "a", "s2": "c"}, {"s1": "b"}]
    if case == "missing":
        parts[1] = {}
    if case == "twice":
        parts[1]["s0"] = "again"
    for k, (shard, stories) in enumerate(zip(shards, parts)):
        shard.write_text(json.dumps(stories))
        complete = not (case == "incomplete" and k == 1)
        shard.with_name(shard.stem + ".meta.json").write_text(json.dumps({"complete": complete, "failures": {}}))
    message = {"incomplete": "rank1-of-2.json: shard is not complete", "missing": "miss story 's1'",
               "twice": "story 's0' is also in another shard"}[case]
    with pytest.raises(ValueError, match=message):
        merge_shards(out, shards, records)
    assert not out.exists() and all(s.exists() for s in shards)


@pytest.mark.parametrize("change, message", [
    ({"settings": ["visual", "sideways"]}, r"models\[0\] \(llava_next\), cell sideways/P1: .*setting must be one of"),
    ({"prompts": ["P1", "P9"]}, r"models\[0\] \(llava_next\), cell visual/P9: .*no visual prompt named 'P9'"),
    ({"models": [{"name": "x", "options": {}, "colour": "red"}]}, r"models\[0\] \(x\): .*unknown option 'colour'"),
    ({"models": [{"name": "x", "options": {"setting": "visual"}}]}, r"models\[0\] \(x\): .*set 'setting' with settings"),
    ({"generation": {"max_new_tokns": 3}}, r"generation: no model's generator has option\(s\) max_new_tokns"),
    ({"rewards": {"fluency": {}}}, r"rewards: 'fluency' is not a d_HM dimension"),
    ({"rewards": {"coherence": {"mode": "sideways"}}}, r"rewards.coherence: .*mode must be one of"),
    ({"rewards": {"repetition": "configs/rewards/nope.yaml"}}, r"rewards.repetition: no such reward config file"),
    ({"limit": 0}, r"limit must be >= 1"),
])
def test_config_errors_name_the_file_and_the_key(assets, tmp_path, change, message):
    from storyrl.eval.sweep import SweepConfig

    path = _write(tmp_path / "bad.yaml", _config(assets, tmp_path / "out", **change))
    with pytest.raises(ValueError, match=f"^{path}: .*{message}"):
        SweepConfig.from_yaml(path)


def test_a_reward_config_of_another_reward_is_refused_before_generating(assets, tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    rewards = {"coherence": REPETITION}
    with pytest.raises(ValueError, match=r"bad.yaml: rewards.coherence: the config is a 'repetition' reward"):
        from storyrl.eval.sweep import SweepConfig, run_sweep

        run_sweep(SweepConfig.from_yaml(_write(tmp_path / "bad.yaml", _config(assets, tmp_path / "o", rewards=rewards))))
    assert calls.ids == []


def test_cli_prints_the_table_and_fails_without_any_d_hm(assets, swept, tmp_path):
    from storyrl.cli import main

    out = tmp_path / "out"
    shutil.copytree(swept[0], out)
    path = _write(tmp_path / "sweep.yaml", _config(assets, out))
    result = CliRunner().invoke(main, ["sweep", "--config", str(path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert swept[1].markdown in result.output and f"plot: {out / 'dhm.png'}" in result.output

    # Only the BLIP-2 cells, whose stories are never scorable: no d_HM anywhere.
    path = _write(tmp_path / "blip.yaml", _config(assets, out, models=_config(assets, out)["models"][1:]))
    result = CliRunner().invoke(main, ["sweep", "--config", str(path), "--quiet"])
    assert result.exit_code == 1 and "Error: no cell has a d_HM" in result.output

    path = _write(tmp_path / "bad.yaml", _config(assets, out, settings=["nowhere"]))
    result = CliRunner().invoke(main, ["sweep", "--config", str(path), "--quiet"])
    assert result.exit_code == 1 and result.output.startswith(f"Error: {path}: ") and "Traceback" not in result.output


def test_cells_per_model_settings_and_generators_without_settings(tmp_path):
    from storyrl.eval.sweep import SweepConfig, plan_cells

    tapm = tmp_path / "tapm"
    tapm.mkdir()
    config = SweepConfig(
        data="d.jsonl", output_dir=str(tmp_path / "out"), image_root=str(tmp_path), settings=["visual", "no_context"],
        prompts=["P1", "P3"], generation={"max_new_tokens": 500, "sequence_image_size": "8x8"},
        rewards={"repetition": {}},
        models=[{"name": "a", "options": {"model": "m"}, "settings": ["prev_sentence"]},
                {"name": "t", "generator": "tapm", "options": {"model": str(tapm), "max_new_tokens": 30}}])
    cells = plan_cells(config)
    assert [c.label for c in cells] == ["a/prev_sentence/P1", "a/prev_sentence/P3", "t/-/-"]
    assert cells[0].options == {"max_new_tokens": 500, "sequence_image_size": "8x8", "image_root": str(tmp_path),
                                "model": "m", "setting": "prev_sentence", "prompt": "P1"}
    # shared options the generator does not declare are left out; the model's own win
    assert cells[2].options == {"max_new_tokens": 30, "image_root": str(tmp_path), "model": str(tapm)}
    assert cells[2].directory == tmp_path / "out" / "cells" / "t" / "-" / "-"


@pytest.mark.parametrize("name, cells", [("dhm_vist", 36), ("dhm_vwp", 3)])
def test_shipped_sweep_configs_load(monkeypatch, name, cells):
    from storyrl.eval.sweep import SweepConfig, plan_cells

    monkeypatch.chdir(Path(REPETITION).parents[2])  # reward config paths are relative to the checkout
    config = SweepConfig.from_yaml(f"configs/sweeps/{name}.yaml")
    planned = plan_cells(config)
    assert len(planned) == cells and planned[0].options["max_new_tokens"] == 500
    assert planned[0].options["model"] == "llava-hf/llava-v1.6-mistral-7b-hf"


def test_two_processes_shard_the_stories_and_merge_them(assets, swept, tmp_path):
    """Two CPU processes under torch's launcher (what accelerate launch runs):
    the merged cell equals the single-process one."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    config = _config(assets, out, models=_config(assets, out)["models"][:1], settings=["prev_sentence"],
                     prompts=["P2"], rewards={"repetition": REPETITION})
    path = _write(tmp_path / "two.yaml", config)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "storyrl", "sweep", "--config", str(path), "--quiet"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("## d_HM per cell") == 1  # only the main process reports
    cell = out / "cells" / "llava_next" / "prev_sentence" / "P2"
    single = swept[0] / "cells" / "llava_next" / "prev_sentence" / "P2"
    assert sorted(p.name for p in cell.iterdir()) == ["scores.csv", "stories.json", "stories.meta.json"]
    assert (cell / "stories.json").read_text() == (single / "stories.json").read_text()
    meta = json.loads((cell / "stories.meta.json").read_text())
    assert meta["shards"] == 2 and meta["complete"] is True and list(meta["failures"]) == ["s3"]
