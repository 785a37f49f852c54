"""benchmarks/gpu_suite.py on the CPU (``--tiny``): every part has its
section with figures or a one-line skip reason, the numbers parse, the
batched and one-at-a-time ways agree, the CUDA-only parts say why they were
skipped, the options do what they say, and the full-size architectures have
their published parameter counts."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_suite
import gpu_suite_arch
import gpu_suite_parts
import gpu_suite_report
import gpu_suite_rl

pytestmark = pytest.mark.slow


def sections(report: str) -> dict[str, str]:
    """Part key -> the text of its ``## ... (`key`)`` section."""
    out = {}
    for block in re.split(r"\n(?=## )", report):
        head = re.match(r"## .*\(`(\w+)`\)\n", block)
        if head:
            out[head.group(1)] = block
    return out


def tables(text: str) -> list[list[dict[str, str]]]:
    """The Markdown tables of ``text``, each a list of {column: cell}."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(---\|)+", lines[i + 1]):
            head = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for body in lines[i + 2:]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(head, (c.strip() for c in body.strip("|").split("|")))))
            found.append(rows)
    return found


NUMERIC = re.compile(r"/s|\(s\)|speed-up|diff|\(M\)|GiB\)|^stories$|^pairs$|^images$|^batch$")


ENV_AROUND_RUN: dict[str, str | None] = {}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("suite") / "report.md"
    ENV_AROUND_RUN["before"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    status = gpu_suite.main(["--tiny", "--device", "cpu", "--threads", "1", "--out", str(out)])
    ENV_AROUND_RUN["after"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    text = out.read_text(encoding="utf-8")
    assert status == 0, text
    return text


# --precision fp16 / bf16: the parts whose models take a dtype (arch counts shapes only). The RL part, the
# expensive one, runs at bf16 (the policy's dtype on a GPU under storyrl's auto), fp16's RL at fp32's cost is
# left out to keep this file's time near one --tiny run's; the rewards inside it run at bf16 too.
PRECISION_PARTS = {"fp16": ["generate", "clip", "pairs"], "bf16": ["generate", "clip", "pairs", "rl"]}


@pytest.fixture(scope="module")
def precision_reports(tmp_path_factory) -> dict[str, str]:
    out = {}
    for precision, parts in PRECISION_PARTS.items():
        path = tmp_path_factory.mktemp(f"suite_{precision}") / "report.md"
        status = gpu_suite.main(["--tiny", "--device", "cpu", "--threads", "1", "--precision", precision,
                                 "--parts", ",".join(parts), "--out", str(path)])
        out[precision] = path.read_text(encoding="utf-8")
        assert status == 0, out[precision]  # a dtype error in any model is a FAILED row: exit status 1
    return out


@pytest.mark.parametrize("precision", list(PRECISION_PARTS))
def test_tiny_runs_at_each_precision(precision_reports, precision):
    """--tiny at fp16 and bf16 on the CPU: every part runs (no FAILED row),
    and every model-backed row's weights really are in that dtype."""
    report = precision_reports[precision]
    assert f"- precision: {precision} (rewards, generation, the RL policy and its rewards)" in report
    found = sections(report)
    assert list(found) == PRECISION_PARTS[precision]
    summary = {r["part"]: r["status"] for r in tables(report.split("\n## ", 2)[1])[0]}
    assert set(summary.values()) == {"ok"}, summary
    checked = 0
    for key, text in found.items():
        assert "FAILED" not in text, text
        rows = [r for t in tables(text) for r in t]
        assert rows, key
        for r in rows:
            weights = r.get("policy weights", r.get("weights"))
            assert weights == precision, (key, r)
            checked += 1
            if "precision" in r:
                assert r["precision"] == precision, (key, r)
    # generate 2 settings, clip 4 rows + ResNet, pairs 2, rl 4
    assert checked == 9 + (4 if "rl" in found else 0)
    if "rl" in found:
        assert f"- precision: {precision} for the policy, {precision} for the dhm reward's models" in found["rl"]


def test_every_part_has_figures_or_a_skip_reason(report):
    found = sections(report)
    assert list(found) == list(gpu_suite.PARTS)
    for key, text in found.items():
        has_table = any(rows for rows in tables(text))
        skip = re.search(rf"- skipped: {key}: \S.+", text)
        assert has_table or skip, (key, text)
        assert "FAILED" not in text, text
        assert re.search(r"- time: \d+\.\d s", text)
    summary = {r["part"]: r["status"] for r in tables(report.split("\n## ", 2)[1])[0]}
    assert summary == {"arch": "ok", "generate": "ok", "clip": "ok", "pairs": "ok", "rl": "ok",
                       "deepspeed": "skipped"}
    assert "- device: CPU only" in report and "- mode: --tiny" in report
    assert re.search(r"\n- command: `python benchmarks/gpu_suite.py --tiny --device cpu --threads 1 --out \S+`\n", report)
    assert "INCOMPLETE" not in report  # written after every part; the last write is the whole report
    # --precision auto on the CPU: every model in fp32
    assert "- precision: auto: fp32 for the rewards and generation" in report
    weights = [r.get("policy weights", r.get("weights")) for text in found.values() for t in tables(text) for r in t
               if "weights" in r or "policy weights" in r]
    assert len(weights) == 13 and set(weights) == {"fp32"}, weights
    assert "- noun phrases (the dhm reward's GROOViST): regex (--tiny: the cheap regular expression)" in found["rl"]


def test_numbers_parse(report):
    checked = 0
    for key, text in sections(report).items():
        for rows in tables(text):
            for row in rows:
                for column, cell in row.items():
                    if not NUMERIC.search(column):
                        continue
                    if cell == "—" and "peak" in column:  # no CUDA: no peak
                        continue
                    value = float(cell)
                    assert math.isfinite(value) and value >= 0, (key, column, cell)
                    checked += 1
    assert checked > 40


def test_batched_and_one_at_a_time_agree(report):
    found = sections(report)
    generated = tables(found["generate"])[0]
    assert {r["setting"] for r in generated} == {"visual", "prev_sentence"}
    assert all(r["precision"] == "fp32" and r["same stories"] == "yes" and r["differing"] == "0" for r in generated)
    pairs = tables(found["pairs"])[0]
    assert [r["model"].split(" ")[0] for r in pairs] == ["RoViST-C", "Vrank"]
    for r in pairs:
        assert float(r["max abs diff"]) < 1e-5, r
        assert float(r["pairs"]) > 10
    # the RoViST-C row carries the verdict against the 5x target; Vrank's has none
    assert pairs[0]["target >= 5x"] in ("PASS", "FAIL") and pairs[1]["target >= 5x"] == "—"
    clip = tables(found["clip"])[0]
    assert {(r["reward"], r["CLIP"]) for r in clip} == {
        (reward, f"{name} (tiny)") for reward in ("groovist", "clipscore") for name in ("ViT-B-32", "ViT-L-14")}
    for r in clip:
        assert r["first = revisit scores"] == "yes"
        # 2 sequences of 5 images; GROOViST encodes each image's 3x3 grid + the whole image
        assert r["images"] == "10" and r["crops encoded"] == ("100" if r["reward"] == "groovist" else "10")


def test_cuda_parts_say_why_they_were_skipped(report):
    found = sections(report)
    for key, what in [("generate", "4-bit NF4"), ("generate", "vLLM"),
                      ("rl", "LLaMA-2-7B 4-bit + LoRA, its 4-bit base")]:
        assert re.search(rf"- skipped: {re.escape(what)}: no CUDA device", found[key]), (key, what)
    assert re.search(r"- skipped: deepspeed: (deepspeed is not installed|no CUDA device)", found["deepspeed"])


def test_rl_time_split_and_estimates(report):
    rows = tables(sections(report)["rl"])[0]
    assert [(r["model"], r["algorithm"]) for r in rows] == [
        ("LLaVA-NeXT-7B + LoRA (tiny)", "PPO"), ("LLaVA-NeXT-7B + LoRA (tiny)", "GRPO"),
        ("LLaMA-2-7B + LoRA (tiny)", "PPO"), ("LLaMA-2-7B + LoRA (tiny)", "GRPO")]
    estimates = gpu_suite_rl.readme_estimates()
    assert set(estimates) == {"llava", "llama"} and all("GiB" in v for v in estimates.values())
    for r in rows:
        shares = [float(r[p].rstrip(" %")) for p in ("generation", "forward", "reward", "optimisation")]
        assert abs(sum(shares) - 100) <= 2 and r["reward"] != "0 %", r  # rounded shares of the step
        assert r["README estimate"] == estimates["llava" if r["model"].startswith("LLaVA") else "llama"]
        # plain generate next to the generation phase, LoRA unmerged and merged (rl_generate.py)
        unmerged, merged = (float(r[f"plain generate, {v} (ms/token)"]) for v in ("LoRA unmerged", "merged"))
        assert unmerged > 0 and merged > 0 and float(r["RL generation (ms/token)"]) > 0
        assert float(r["generation / generate"]) > 0 and r["target <= 1.25"] in ("PASS", "FAIL")
    assert "- generation / generate: the RL step's generation phase" in sections(report)["rl"]
    # the RLConfig patch is undone after the runs
    from storyrl.training.storyteller.rl.config import RLConfig

    assert "rl_options" not in RLConfig.from_mapping.__func__.__qualname__


# Published parameter counts (model cards / papers; exact where the reference code gives them).
FULL_SIZE = {
    "LLaMA-2-7B": 6_738_415_616,
    "Mistral-7B": 7_241_732_096,
    "ALBERT-large": 17_683_968,
    "BERT-large": 335_141_888,
    "CLIP ViT-B/32": 151_277_313,
    "CLIP ViT-L/14": 427_616_513,
    "ResNet-50 v2": 25_549_352,
}


def test_full_size_parameter_counts(report):
    builders = gpu_suite_arch.architectures(tiny=False)
    for name, expected in FULL_SIZE.items():
        assert gpu_suite_arch.count_parameters(builders[name]) == expected, name
        assert abs(expected / gpu_suite_arch.EXPECTED_PARAMETERS[name] - 1) < 0.01
    # LLaVA-NeXT: Mistral-7B with its 32,064-token vocabulary + CLIP ViT-L/14-336 (303.5 M) + projector (21.0 M)
    llava = gpu_suite_arch.count_parameters(builders["LLaVA-NeXT-7B (Mistral-7B + CLIP ViT-L/14-336)"])
    assert llava == 7_566_747_648
    # and the report's arch table shows the same counts in millions
    rows = {r["architecture"]: float(r["parameters (M)"]) for r in tables(sections(report)["arch"])[0]}
    for name, expected in FULL_SIZE.items():
        assert rows[name] == pytest.approx(expected / 1e6, rel=1e-3)
    # --tiny shrinks every one of them below a few million parameters
    for name, build in gpu_suite_arch.architectures(tiny=True).items():
        assert gpu_suite_arch.count_parameters(build) < 3e6, name


def test_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "r.md"
    out.write_text("keep me")
    assert gpu_suite.main(["--tiny", "--parts", "deepspeed", "--out", str(out)]) == 2
    assert out.read_text() == "keep me"
    assert "--overwrite" in capsys.readouterr().err
    assert gpu_suite.main(["--tiny", "--parts", "deepspeed", "--out", str(out), "--overwrite"]) == 0
    assert list(sections(out.read_text())) == ["deepspeed"]


def test_budget_and_parts(tmp_path):
    out = tmp_path / "r.md"
    # 0.01 min = 0.6 s: the pairs part's estimate (10 s with --tiny) does not fit, deepspeed's (1 s) neither
    assert gpu_suite.main(["--tiny", "--parts", "deepspeed,pairs", "--budget-minutes", "0.01", "--out", str(out)]) == 0
    found = sections(out.read_text())
    assert list(found) == ["pairs", "deepspeed"]  # suite order, not the order given
    assert re.search(r"- skipped: pairs: time budget: needs ~0\.2 min, 0\.0 min left of 0\.01", found["pairs"])
    assert not tables(found["pairs"])


@pytest.mark.parametrize("argv, message", [
    (["--parts", "arch,nope"], "--parts: unknown nope"),
    (["--parts", ","], "--parts: unknown (none given)"),
    (["--budget-minutes", "0"], "--budget-minutes must be > 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_suite.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_device_refused_without_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert gpu_suite.main(["--device", "cuda", "--out", str(tmp_path / "r.md")]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


def test_rows_skip_or_fail_without_stopping_the_part():
    section = gpu_suite_report.Section("x", "X")
    done = []
    for what, error in [("a", gpu_suite_report.Skip("no CUDA device (a needs one)")),
                        ("b", RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")),
                        ("c", ValueError("bad\nshape"))]:
        with gpu_suite_report.row(section, what):
            raise error
        done.append(what)
    with gpu_suite_report.row(section, "d"):
        section.table([{"figure": 1.5, "flag": True, "none": None}])
    assert done == ["a", "b", "c"]
    assert section.status == "failed"
    assert section.lines[:3] == ["- skipped: a: no CUDA device (a needs one)",
                                 "- skipped: b: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB",
                                 "- FAILED: c: ValueError: bad shape"]
    assert tables("\n".join(section.lines)) == [[{"figure": "1.5", "flag": "yes", "none": "—"}]]


def test_a_failed_part_sets_the_exit_status(tmp_path, monkeypatch):
    def broken(ctx, section):
        with gpu_suite_report.row(section, "first row"):
            section.table([{"pairs/s": 2.0}])
        with gpu_suite_report.row(section, "second row"):
            raise KeyError("weights")

    def all_skipped(ctx, section):
        with gpu_suite_report.row(section, "only row"):
            ctx.need_cuda("the only row")

    monkeypatch.setitem(gpu_suite.PARTS, "pairs", ("3. pairs", broken, 1, 1))
    monkeypatch.setitem(gpu_suite.PARTS, "clip", ("2. clip", all_skipped, 1, 1))
    out = tmp_path / "r.md"
    assert gpu_suite.main(["--tiny", "--device", "cpu", "--parts", "pairs,clip", "--out", str(out)]) == 1
    text = out.read_text()
    found = sections(text)
    assert tables(found["pairs"]) == [[{"pairs/s": "2"}]]
    assert "- FAILED: second row: KeyError: 'weights'" in found["pairs"]
    assert "- skipped: only row: no CUDA device (the only row needs one)" in found["clip"]
    summary = {r["part"]: r["status"] for r in tables(text.split("\n## ", 2)[1])[0]}
    assert summary == {"clip": "skipped", "pairs": "failed"}


def test_budget():
    budget = gpu_suite_report.Budget(1.0)
    budget.check(30, "fits")
    with pytest.raises(gpu_suite_report.Skip, match=r"time budget: needs ~2\.0 min, 1\.0 min left of 1 \(too big\)"):
        budget.check(120, "too big")


# -- figures computed right (each test plants inputs whose answer is known) ----------------------


def test_arch_figures_row_by_row(report):
    section = sections(report)["arch"]
    rows = tables(section)[0]
    assert [r["architecture"] for r in rows] == list(gpu_suite_arch.architectures(tiny=False))
    for r in rows:
        millions = float(r["parameters (M)"])
        # fp16: 2 bytes a parameter, in GiB
        assert float(r["fp16 weights (GiB)"]) == pytest.approx(2 * millions * 1e6 / 2**30, rel=2e-3), r
        # each row its own published figure, looked up by its whole name
        assert float(r["published (M)"]) == pytest.approx(
            gpu_suite_arch.EXPECTED_PARAMETERS[r["architecture"]] / 1e6, rel=1e-3), r
    published = {r["architecture"]: r["published (M)"] for r in rows}
    # LLaVA-NeXT-7B's name contains Mistral-7B's and CLIP ViT-L/14's: its figure is its own (7.57 B), not theirs
    assert published["LLaVA-NeXT-7B (Mistral-7B + CLIP ViT-L/14-336)"] == "7570"
    assert published["Mistral-7B"] == "7240"
    # the --tiny note: the shrunk models' counts, in thousands
    note = next(line for line in section.splitlines() if line.startswith("- --tiny runs these shrunk"))
    for name, build in gpu_suite_arch.architectures(tiny=True).items():
        assert f"{name} {gpu_suite_arch.count_parameters(build) / 1e3:.1f} k" in note, (name, note)


def test_used_time_is_the_parts_time(report):
    found = re.search(r"\n- budget: (\S+) min; used (\d+\.\d) min\n", report)
    budget, used = float(found[1]), float(found[2])
    seconds = sum(float(r["seconds"]) for r in tables(report.split("\n## ", 2)[1])[0])
    assert used <= budget
    # 0.1 min of rounding, plus a few seconds between the parts (writing the report)
    assert abs(used * 60 - seconds) <= 3 + 5, (used, seconds)


def test_cuda_visible_devices_restored(report, monkeypatch):
    assert ENV_AROUND_RUN["after"] == ENV_AROUND_RUN["before"]  # the rl part hides GPUs only while it runs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with gpu_suite_rl._hidden_gpus(True):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with gpu_suite_rl._hidden_gpus(True):
        pass
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_generate_counts_the_differing_stories(tmp_path, monkeypatch):
    import generate as gen

    import storyrl.models.vlm

    def write_data(directory, n, size):
        records = directory / "data.jsonl"
        records.write_text("".join(json.dumps({"story_id": f"s{k}", "images": [f"{k}_{i}.png" for i in range(5)]})
                                   + "\n" for k in range(n)))
        return records

    class Authors:
        def __init__(self, *args):
            pass

        def story(self, setting, images):
            return f"{setting} {images[0]}"

    planted = {"visual": {"s0", "s2"}, "prev_sentence": {"s0"}}  # the first story differs in both

    def storyrl_way(ctx, model_dir, setting, records, out, **options):
        lines = [json.loads(x) for x in Path(records).read_text().splitlines()]
        return 1.0, {r["story_id"]: f"{setting} {r['images'][0]}" + (" !" if r["story_id"] in planted[setting] else "")
                     for r in lines}

    monkeypatch.setattr(gen, "build_model", lambda shape, directory, device: str(directory))
    monkeypatch.setattr(gen, "write_data", write_data)
    monkeypatch.setattr(gen, "Authors", Authors)
    monkeypatch.setattr(storyrl.models.vlm, "load_vlm", lambda *args: SimpleNamespace(model=None, device="cpu"))
    monkeypatch.setattr(gpu_suite_parts, "_generate_storyrl", storyrl_way)
    section = gpu_suite_report.Section("generate", "1.")
    gpu_suite_parts.part_generate(gpu_suite_report.Context(True, "cpu", gpu_suite_report.Budget(5), tmp_path), section)
    rows = tables("\n".join(section.lines))[0]
    assert [(r["setting"], r["stories"], r["same stories"], r["differing"]) for r in rows] == [
        ("visual", "3", "no", "2"), ("prev_sentence", "3", "no", "1")]
    planted.update(visual=set(), prev_sentence=set())
    section = gpu_suite_report.Section("generate", "1.")
    gpu_suite_parts.part_generate(gpu_suite_report.Context(True, "cpu", gpu_suite_report.Budget(5), tmp_path / "again"),
                                  section)
    rows = tables("\n".join(section.lines))[0]
    assert [(r["same stories"], r["differing"]) for r in rows] == [("yes", "0"), ("yes", "0")]


def test_authors_prompts_are_storyrls(monkeypatch):
    """The one-at-a-time way sends storyrl's prompt text (the tiny random
    LLaVA writes the same story whatever it is told, so the run cannot tell)."""
    import generate as gen
    import transformers

    from storyrl.generators import create_generator

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda *args, **kwargs: None)
    authors = gen.Authors("unused", None, "cpu", None, 6, "P3", None)
    sent = []
    monkeypatch.setattr(authors, "call", lambda prompt, image: sent.append(prompt) or f"sentence {len(sent)} .")
    monkeypatch.setattr(authors, "sequence_image", lambda paths: None)
    import PIL.Image

    monkeypatch.setattr(PIL.Image, "open", lambda path: SimpleNamespace(convert=lambda mode: None))  # no files
    storyrl = {setting: create_generator("prompting", model="unused", setting=setting, prompt="P3",
                                         chat_format="authors") for setting in ("visual", "prev_sentence")}
    for n in (5, 3):
        authors.story("visual", [f"{i}.png" for i in range(n)])
        assert sent[-1] == storyrl["visual"].wrap(storyrl["visual"].prompt_text(n))
        assert ("five" if n == 5 else "three") in sent[-1]
    sent.clear()
    authors.story("prev_sentence", [f"{i}.png" for i in range(5)])
    g = storyrl["prev_sentence"]
    assert sent == [g.wrap(g.prompt_text(context=g._context([f"sentence {i} ." for i in range(1, k + 1)])))
                    for k in range(5)]


def test_clip_first_and_revisit_scores_compared(tmp_path, monkeypatch):
    import numpy as np

    import storyrl.rewards

    class Reward:
        grid = 3

        def __init__(self, name):
            self.name, self.calls = name, 0

        def setup(self):
            pass

        def score(self, stories, images):
            self.calls += 1
            scores = np.linspace(0.1, 0.4, len(stories))
            if self.name == "groovist" and self.calls == 2:
                scores[-1] += 1e-3  # the revisit differs in the last story only
            return scores

    def no_resnet(tiny):
        raise gpu_suite_report.Skip("not in this test")

    monkeypatch.setattr(storyrl.rewards, "create_reward", lambda name, **options: Reward(name))
    monkeypatch.setattr(gpu_suite_parts, "_save_clip", lambda directory, cfg: "local-dir:unused")
    monkeypatch.setattr(gpu_suite_parts, "resnetv2", no_resnet)
    section = gpu_suite_report.Section("clip", "2.")
    gpu_suite_parts.part_clip(gpu_suite_report.Context(True, "cpu", gpu_suite_report.Budget(5), tmp_path), section)
    rows = tables("\n".join(section.lines))[0]
    assert {(r["reward"], r["CLIP"]): r["first = revisit scores"] for r in rows} == {
        ("groovist", "ViT-B-32 (tiny)"): "no", ("clipscore", "ViT-B-32 (tiny)"): "yes",
        ("groovist", "ViT-L-14 (tiny)"): "no", ("clipscore", "ViT-L-14 (tiny)"): "yes"}


class VrankSkipped(gpu_suite_report.Budget):
    def check(self, seconds, what):
        if what == "Vrank":
            raise gpu_suite_report.Skip("not in this test")


@pytest.mark.parametrize("one_s, verdict", [(4.9, "FAIL"), (5.0, "PASS")])
def test_rovist_speed_up_and_verdict(one_s, verdict, tmp_path, monkeypatch):
    real = gpu_suite_parts.timed

    def timed(fn, device, *args, **kwargs):  # the real work, planted seconds
        return (one_s if fn is gpu_suite_parts._one_pair_per_forward else 1.0), real(fn, device, *args, **kwargs)[1]

    monkeypatch.setattr(gpu_suite_parts, "timed", timed)
    section = gpu_suite_report.Section("pairs", "3.")
    gpu_suite_parts.part_pairs(gpu_suite_report.Context(True, "cpu", VrankSkipped(5), tmp_path), section)
    [r] = tables("\n".join(section.lines))[0]
    pairs = float(r["pairs"])
    assert float(r["one per forward (pairs/s)"]) == pytest.approx(pairs / one_s, rel=1e-3)
    assert float(r["batched (pairs/s)"]) == pytest.approx(pairs, rel=1e-3)
    # speed-up = batched pairs/s / one-per-forward pairs/s
    assert float(r["speed-up"]) == pytest.approx(one_s, rel=1e-3)
    assert float(r["speed-up"]) == pytest.approx(float(r["batched (pairs/s)"]) / float(r["one per forward (pairs/s)"]),
                                                 rel=2e-3)
    assert r["target >= 5x"] == verdict


def test_rl_row_shares_and_peak():
    import rl_step

    steps = [{"step": 2.0, "generation": 1.0, "forward": 0.5, "reward": 0.3, "optimisation": 0.2},
             {"step": 4.0, "generation": 2.4, "forward": 0.6, "reward": 0.5, "optimisation": 0.5}]
    row = gpu_suite_rl._rl_row("M", "grpo", (steps, [], 7.5), 9.0, rl_step.summarise, 3 * 1024 + 512, "14 GiB")
    share = rl_step.summarise("grpo", steps, [], None)["share"]
    assert {p: row[p] for p in rl_step.PHASES} == {p: f"{100 * share[p]:.0f} %" for p in rl_step.PHASES}
    # by hand: means 3.0 s a step, 1.7 / 0.55 / 0.4 / 0.35 s
    assert [row[p] for p in ("generation", "forward", "reward", "optimisation")] == ["57 %", "18 %", "13 %", "12 %"]
    assert (row["algorithm"], row["step (s)"], row["run (s)"], row["rewards prepared (s)"]) == ("GRPO", 3.0, 9.0, 7.5)
    assert row["peak GiB"] == 3.5 and row["README estimate"] == "14 GiB"  # MiB / 1024
    row = gpu_suite_rl._rl_row("M", "grpo", (steps, []), 9.0, rl_step.summarise, None, None)
    assert row["peak GiB"] is None and row["rewards prepared (s)"] is None
    assert row["README estimate"] == "not found in benchmarks/README.md"
    assert row["generation / generate"] is None and row["target <= 1.25"] is None
    generate = {"ms_per_token": {"generation": 3.0, "generate_call": 2.8, "unmerged": 4.0, "merged": 2.5},
                "generation_over_generate": 1.3}
    row = gpu_suite_rl._rl_row("M", "grpo", (steps, [], 7.5, generate), 9.0, rl_step.summarise, None, None)
    assert [row[k] for k in ("RL generation (ms/token)", "plain generate, LoRA unmerged (ms/token)",
                             "plain generate, merged (ms/token)", "generation / generate", "target <= 1.25")] == \
        [3.0, 4.0, 2.5, 1.3, "FAIL"]
    plain = {"ms_per_token": {"generation": 3.0, "plain": 2.9}, "generation_over_generate": 1.1}
    row = gpu_suite_rl._rl_row("M", "grpo", (steps, [], 7.5, plain), 9.0, rl_step.summarise, None, None)
    assert row["plain generate, LoRA unmerged (ms/token)"] is None and row["plain generate, merged (ms/token)"] == 2.9
    assert row["target <= 1.25"] == "PASS"


def test_budget_counts_the_time_left(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(gpu_suite_report.time, "perf_counter", lambda: clock[0])
    budget = gpu_suite_report.Budget(1.0)
    clock[0] = 142.0  # 18 s left of 60
    budget.check(15, "fits what is left")
    with pytest.raises(gpu_suite_report.Skip,
                       match=r"^time budget: needs ~0\.5 min, 0\.3 min left of 1 \(fits the total\)$"):
        budget.check(30, "fits the total")
    clock[0] = 200.0
    with pytest.raises(gpu_suite_report.Skip, match=r"needs ~0\.0 min, 0\.0 min left of 1 "):
        budget.check(1, "past the budget")

    # in the driver: the first part spends 50 s of 60; the second's 15 s no longer fit
    def slow(ctx, section):
        clock[0] += 50
        section.table([{"figure": 1}])

    clock[0] = 0.0
    ran = []
    monkeypatch.setitem(gpu_suite.PARTS, "arch", ("arch", slow, 1, 1))
    monkeypatch.setitem(gpu_suite.PARTS, "deepspeed", ("deepspeed", lambda ctx, s: ran.append(1), 1, 15))
    out = tmp_path / "r.md"
    assert gpu_suite.main(["--tiny", "--device", "cpu", "--parts", "arch,deepspeed", "--budget-minutes", "1",
                           "--out", str(out)]) == 0
    assert ran == []
    assert "- skipped: deepspeed: time budget: needs ~0.2 min, 0.2 min left of 1 (estimate of part deepspeed)" \
        in sections(out.read_text())["deepspeed"]


def test_out_in_a_missing_directory(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setitem(gpu_suite.PARTS, "arch", ("arch", lambda ctx, section: ran.append(1), 1, 1))
    out = tmp_path / "missing" / "r.md"
    assert gpu_suite.main(["--tiny", "--device", "cpu", "--parts", "arch", "--out", str(out)]) == 2
    assert ran == [] and not out.parent.exists()
    assert f"--out {out}: no directory {out.parent}" in capsys.readouterr().err


def test_deepspeed_launch_exit_status(tmp_path, monkeypatch):
    launched = []

    def launch(tmp, options, steps=3, timeout=600):
        launched.append(options)
        return result

    monkeypatch.setattr(gpu_suite_report, "_have", lambda module: True)  # deepspeed "installed"
    monkeypatch.setattr(gpu_suite_rl, "launch_rl_steps", launch)
    ctx = gpu_suite_report.Context(False, "cuda", gpu_suite_report.Budget(40), tmp_path)
    result = (1, "Traceback (most recent call last): ... boom", 2.0, [])
    with pytest.raises(RuntimeError, match=r"^storyrl launch exited 1: Traceback .* boom$"):
        gpu_suite_rl.part_deepspeed(ctx, gpu_suite_report.Section("deepspeed", "5."))
    result = (0, "", 12.0, [{"time/step": 1.0}, {"time/step": 3.0}, {"loss": 0.5}])
    section = gpu_suite_report.Section("deepspeed", "5.")
    gpu_suite_rl.part_deepspeed(ctx, section)
    [r] = tables("\n".join(section.lines))[0]
    assert (r["steps logged"], r["mean step (s)"], r["run incl. start (s)"]) == ("3", "2", "12")
    zero2 = str(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml")
    assert launched == [["--config_file", zero2, "--num_processes", "1"]] * 2


def test_vocabularies_reach_the_real_sizes(tmp_path):
    """Every tokenizer the suite builds at full size has its architecture's
    vocabulary size (tokenizers' WordLevelTrainer stops at 30,000 words by
    default: LLaVA-NeXT-7B's 32,064 once failed its own check on the GPU)."""
    import generate as gen

    texts = [gen.PROMPTS_FILE.read_text(), gen.EXTRA_WORDS]
    llava = gen._tokenizer(texts, gen.SHAPES["7b"]["vocab"])
    assert len(llava) == gen.SHAPES["7b"]["vocab"] == 32064
    assert llava.convert_tokens_to_ids("<image>") != llava.unk_token_id and llava.image_token == "<image>"
    ids = llava("[INST] <image>\nthe dog w31000 [/INST]").input_ids
    assert llava.decode(ids) == "[INST] <image> the dog w31000 [/INST]"
    llama = gpu_suite_rl.llama_tokenizer(texts)
    assert len(llama) == 32000 and llama.chat_template and llama.eos_token == "[EOS]"
    stories = gpu_suite_parts.synthetic_stories(8)
    albert = gpu_suite_parts.rovist_tokenizer(stories, tiny=False)
    assert len(albert) == 30000
    assert set(albert("the dog .", "a cat .")) >= {"input_ids", "token_type_ids"}
    bert = gpu_suite_parts.vrank_tokenizer(stories, tmp_path / "bert", tiny=False)
    assert len(bert) == 30522
    # the words of the texts keep their ids; only filler words are added
    assert gen.sized_tokenizer(llava, 32064).get_vocab() == llava.get_vocab()
    with pytest.raises(ValueError, match="more than 10"):
        gen.sized_tokenizer(llava, 10)


def test_rl_llava_links_the_shared_weights(tmp_path, monkeypatch):
    """At full size the rl part uses the run's one 7B LLaVA-NeXT build (the
    generate part's too): weights linked, its own processor with a chat
    template, the shared copy unchanged. A tiny model stands in for the 7B."""
    import generate as gen
    from transformers import AutoProcessor

    import gpu_suite_parts

    real = gen.build_model
    monkeypatch.setattr(gen, "build_model", lambda shape, directory, device: real("tiny", directory, "cpu"))
    ctx = gpu_suite_report.Context(False, "cpu", gpu_suite_report.Budget(5), tmp_path)
    shared = Path(gpu_suite_parts.llava_7b(ctx))
    before = {p.name: p.read_bytes() for p in shared.iterdir()}
    policy = Path(gpu_suite_rl._build_llava(tmp_path / "rl" / "llava", ["unused"], ctx))
    assert gpu_suite_parts.llava_7b(ctx) == str(shared)  # built once
    assert {p.name: p.read_bytes() for p in shared.iterdir()} == before
    weights = [p for p in policy.iterdir() if p.suffix == ".safetensors"]
    assert weights and all(p.is_symlink() and p.resolve().parent == shared.resolve() for p in weights)
    assert AutoProcessor.from_pretrained(policy).chat_template == gpu_suite_rl.MISTRAL_CHAT_TEMPLATE
    assert not AutoProcessor.from_pretrained(shared).chat_template
    assert not (tmp_path / "rl" / "llava_processor").exists()


# -- --quick, --precision, the noun-phrase choice ----------------------------------------------


def test_quick_plan_fits_eight_minutes_in_order():
    """--quick: the RL rows (PPO and GRPO) first, then generate (fp16 / 4-bit),
    then CLIP and pairs; its parts' estimates plus the install add up to at
    most 8 minutes, and its default budget is what is left after the install."""
    plan = gpu_suite_report.QUICK_PARTS
    assert gpu_suite.QUICK_ORDER[:4] == ["rl", "generate", "clip", "pairs"]
    assert sorted(gpu_suite.QUICK_ORDER) == sorted(gpu_suite.PARTS) == sorted(plan)
    install = gpu_suite_report.ALLOWANCE["install_s"]
    assert sum(plan.values()) + install <= 8 * 60 == gpu_suite_report.QUICK_TOTAL_S
    args = gpu_suite.parse_args(["--quick"])
    assert args.parts == gpu_suite.QUICK_ORDER and args.quick and not args.tiny
    assert args.budget_minutes == pytest.approx((8 * 60 - install) / 60)
    assert sum(plan[k] for k in args.parts) <= args.budget_minutes * 60
    # the default run keeps the suite order and 40 minutes; an explicit budget is kept
    args = gpu_suite.parse_args([])
    assert args.parts == list(gpu_suite.PARTS) and args.budget_minutes == 40
    assert gpu_suite.parse_args(["--quick", "--budget-minutes", "5"]).budget_minutes == 5
    # the estimates are the measured figures' arithmetic: e.g. the rl part's GRPO runs
    rows, h100, allow = gpu_suite_report.QUICK_ROWS, gpu_suite_report.H100, gpu_suite_report.ALLOWANCE
    # a run: load, 2 steps of 24 new tokens (the 64-token step less 40 tokens at its per-token rate), and for the
    # timed step plain generate replayed unmerged and merged (24 tokens each at that rate, 1 s warm-up each)
    steps, tokens = gpu_suite_report.QUICK_RL_STEPS, gpu_suite_report.QUICK_RL_TOKENS
    assert (steps, tokens) == (2, 24)
    llava_token, llama_token = 7.6 * 0.78 / 64, 9.8 * 0.91 / 64
    assert rows["rl llava run"] == pytest.approx(
        allow["llava_load_s"] + 2 * (7.6 - 40 * llava_token) + 2 * 24 * llava_token + 2 * 1)
    assert rows["rl llama run"] == pytest.approx(
        allow["llama_4bit_load_s"] + 2 * (9.8 - 40 * llama_token) + 2 * 24 * llama_token + 2 * 1 + 2)
    assert plan["rl"] == allow["rl_assets_s"] + rows["rl llava"] + rows["rl llama"]


def test_quick_runs_full_size_and_skips_what_no_longer_fits(tmp_path, monkeypatch):
    """The driver under --quick: parts in QUICK_ORDER, each given a full-size
    (not tiny) quick context; a part whose estimate exceeds the time left is
    skipped with the reason, not started."""
    clock = [0.0]
    monkeypatch.setattr(gpu_suite_report.time, "perf_counter", lambda: clock[0])
    seen = []

    def runner(key, spend):
        def run(ctx, section):
            seen.append((key, ctx.quick, ctx.tiny, ctx.precision))
            clock[0] += spend
            section.table([{"figure": 1}])
        return run

    plan = dict(gpu_suite_report.QUICK_PARTS)
    spend = {"rl": plan["rl"] + 100}  # the rl part overruns its estimate by 100 s
    for key in gpu_suite.PARTS:
        title = gpu_suite.PARTS[key][0]
        monkeypatch.setitem(gpu_suite.PARTS, key, (title, runner(key, spend.get(key, plan[key])), 1, 1))
    out = tmp_path / "r.md"
    assert gpu_suite.main(["--quick", "--device", "cpu", "--precision", "bf16", "--out", str(out)]) == 0
    text = out.read_text()
    assert list(sections(text)) == gpu_suite.QUICK_ORDER
    assert all(quick and not tiny and precision == "bf16" for _, quick, tiny, precision in seen)
    ran = [key for key, *_ in seen]
    assert ran[:2] == ["rl", "generate"] and ran == [k for k in gpu_suite.QUICK_ORDER if k in ran]
    skipped = [k for k in gpu_suite.QUICK_ORDER if k not in ran]
    assert "clip" in skipped and "pairs" in ran  # 100 s over: clip (37 s) no longer fits, pairs (20 s) still does
    for key in skipped:
        assert re.search(rf"- skipped: {key}: time budget: needs ~\d+\.\d min, \d+\.\d min left of 7\.33333 "
                         rf"\(estimate of part {key}\)", sections(text)[key])
    assert "- mode: --quick (full-size architectures" in text
    summary = tables(text.split("\n## ", 2)[1])[0]
    assert [float(r["estimate (s)"]) for r in summary] == pytest.approx([round(plan[k]) for k in gpu_suite.QUICK_ORDER])


@pytest.mark.parametrize("argv, message", [
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--tiny", "--quick"], "not allowed with argument"),
])
def test_bad_mode_and_precision(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_suite.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_context_sizes_and_precision():
    budget = gpu_suite_report.Budget(1)
    ctx = gpu_suite_report.Context
    assert ctx(True, "cpu", budget, Path(".")).pick(1, 2, 3) == 1
    assert ctx(False, "cuda", budget, Path("."), quick=True).pick(1, 2, 3) == 2
    assert ctx(False, "cuda", budget, Path(".")).pick(1, 2, 3) == 3
    assert ctx(False, "cuda", budget, Path(".")).dtype_name == "fp16"
    assert ctx(True, "cpu", budget, Path(".")).dtype_name == "fp32"
    assert ctx(True, "cpu", budget, Path("."), precision="bf16").dtype_name == "bf16"
    # a quick row's budget check takes QUICK_ROWS' estimate
    with pytest.raises(gpu_suite_report.Skip, match=r"needs ~1\.5 min, 1\.0 min left of 1 \(x\)"):
        ctx(False, "cuda", budget, Path("."), quick=True).check("rl llava", 1, 1, "x")


def test_noun_phrase_extractor_chosen_by_what_is_installed(monkeypatch):
    rl_step = SimpleNamespace(NP_EXTRACTORS={"spacy-sm-shape": object, "regex": object})
    monkeypatch.setattr(gpu_suite_rl, "_have", lambda module: module == "spacy")
    assert gpu_suite_rl.noun_phrase_extractor(rl_step, tiny=False) == ("spacy-sm-shape", "spaCy is installed")
    assert gpu_suite_rl.noun_phrase_extractor(rl_step, tiny=True)[0] == "regex"
    monkeypatch.setattr(gpu_suite_rl, "_have", lambda module: False)
    assert gpu_suite_rl.noun_phrase_extractor(rl_step, tiny=False) == (
        "regex", "spaCy is not installed: regular-expression noun phrases")
    assert gpu_suite_rl.noun_phrase_extractor(SimpleNamespace(), tiny=False)[0] == ""  # rl_step's own default


def test_precision_reaches_every_model_of_a_reward_spec():
    spec = {"reward": "dhm", "rewards": {"grounding": {"clip_model": "c", "device": "cpu"},
                                         "coherence": {"model": "m"}}}
    assert gpu_suite_rl._with_precision(spec, "bf16") == {
        "reward": "dhm", "rewards": {"grounding": {"clip_model": "c", "device": "cpu", "precision": "bf16"},
                                     "coherence": {"model": "m", "precision": "bf16"}}}
    assert gpu_suite_rl._with_precision("bleu", "bf16") == "bleu"
    assert "precision" not in spec["rewards"]["coherence"]  # not changed in place


def test_weights_dtype_reads_the_matmul_layers():
    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    assert gpu_suite_report.weights_dtype(model) == "fp32"
    model[1].to(torch.float16)  # the embedding (most parameters) and the norm stay fp32
    assert gpu_suite_report.weights_dtype(model) == "fp16"
    assert gpu_suite_report.weights_dtype(SimpleNamespace(net=model.to(torch.bfloat16))) == "bf16"
    assert gpu_suite_report.weights_dtype((None, model)) == "bf16"
    assert gpu_suite_report.weights_dtype(None, "text") is None


def test_quick_generate_runs_less_work_at_full_size(tmp_path, monkeypatch):
    """--quick's generate part: the 7B shape (built once, shared), 2 stories,
    16 new tokens, one warm-up per model instead of one per setting; the
    model and the GPU are stood in for (the work asked of them is checked)."""
    import generate as gen

    import storyrl.models.vlm

    built, warmups, asked = [], [], []

    def write_data(directory, n, size):
        asked.append(("images", size))
        records = directory / "data.jsonl"
        records.write_text("".join(json.dumps({"story_id": f"s{k}", "images": [f"{k}_{i}.png" for i in range(5)]})
                                   + "\n" for k in range(n)))
        return records

    class Authors:
        def __init__(self, model_dir, model, device, dtype, max_new, prompt, size):
            asked.append(("authors", max_new, dtype))

        def story(self, setting, images):
            return f"{setting} {images[0]}"

    def storyrl_way(ctx, model_dir, setting, records, out, **options):
        lines = [json.loads(x) for x in Path(records).read_text().splitlines()]
        if Path(out).name == "warm.json":
            warmups.append(setting)
        asked.append(("storyrl", options["max_new_tokens"], options["batch_size"], options["precision"]))
        return 1.0, {r["story_id"]: f"{setting} {r['images'][0]}" for r in lines}

    monkeypatch.setattr(gen, "build_model", lambda shape, directory, device: built.append(shape) or str(directory))
    monkeypatch.setattr(gen, "write_data", write_data)
    monkeypatch.setattr(gen, "Authors", Authors)
    monkeypatch.setattr(storyrl.models.vlm, "load_vlm", lambda *args: SimpleNamespace(model=None, device="cuda"))
    monkeypatch.setattr(gpu_suite_parts, "_generate_storyrl", storyrl_way)
    monkeypatch.setattr(gpu_suite_report, "_sync", lambda device: None)  # no CUDA here
    monkeypatch.setattr(gpu_suite_parts, "_reset_peak", lambda device: None)
    monkeypatch.setattr(gpu_suite_parts, "_peak_gib", lambda device: 1.0)
    ctx = gpu_suite_report.Context(False, "cuda", gpu_suite_report.Budget(5), tmp_path, quick=True)
    section = gpu_suite_report.Section("generate", "1.")
    gpu_suite_parts.part_generate(ctx, section)
    rows = tables("\n".join(section.lines))[0]
    assert [(r["precision"], r["setting"], r["stories"]) for r in rows] == [("fp16", "visual", "2"),
                                                                            ("fp16", "prev_sentence", "2")]
    assert built == ["7b"] and ctx.shared["llava_7b"]  # shared with the rl part
    assert warmups == ["visual"]  # one warm-up for the model, not one per setting
    assert {a for a in asked if a[0] == "storyrl"} == {("storyrl", 16, 2, "fp16")}
    assert ("images", gen.SHAPES["7b"]["images"]) in asked
    assert "2 stories x 5 images, batch 2, 16 new tokens per call" in "\n".join(section.lines)
    # the 4-bit row: bitsandbytes is not installed here, its skip says so (or it ran where it is)
    assert re.search(r"- skipped: 4-bit NF4: bitsandbytes is not installed", "\n".join(section.lines)) \
        or any(r["precision"] == "4-bit NF4" for r in rows)
    # the default (not --quick): 8 stories, 32 tokens, a warm-up per setting; the shared build is reused
    warmups.clear()
    asked.clear()
    ctx = gpu_suite_report.Context(False, "cuda", gpu_suite_report.Budget(5), tmp_path / "full", shared=ctx.shared)
    section = gpu_suite_report.Section("generate", "1.")
    (tmp_path / "full").mkdir()
    gpu_suite_parts.part_generate(ctx, section)
    assert built == ["7b"] and warmups == ["visual", "prev_sentence"]
    assert {a for a in asked if a[0] == "storyrl"} == {("storyrl", 32, 8, "fp16")}
    assert "(by the rl part; reused here)" in "\n".join(section.lines)


def test_bf16_refused_on_a_card_without_it(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    out = tmp_path / "r.md"
    assert gpu_suite.main(["--precision", "bf16", "--parts", "arch", "--out", str(out)]) == 2
    assert "--precision bf16: Tesla V100 does not support bfloat16" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("tiny", [False, True])
def test_full_size_rl_rows_train_on_bleu_with_dhm_at_weight_zero(tiny, tmp_path, monkeypatch):
    """Issue 30: PPO at 7B stopped at step 1 because the random 7B policies
    write soup that dhm cannot score, and PPO counts a story only when every
    reward with a non-zero weight scores it (GRPO sums those that did). At
    full size both algorithms get dhm at weight 0 beside bleu (dhm still
    computed and timed); --tiny's fitted policy keeps training on both."""
    import rl_step

    seen: dict[str, tuple] = {}

    def runner(algorithm):
        def run(assets, args, reward, out, prepare=False):
            config = rl_step.rl_config(assets, args, reward, algorithm, out, prepare)
            seen[f"{assets['policy']} {algorithm}"] = ([r if isinstance(r, str) else r["reward"]
                                                        for r in config.rewards], config.reward_weights)
            raise RuntimeError("recorded")  # the row fails; the part goes on

        return run

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"story_id": "s0", "story": "A dog ran.", "images": []}) + "\n")
    assets = {"data": str(data), "policy": "tiny-policy",
              "rewards": {"dhm": [{"reward": "dhm", "rewards": {"repetition": {}}}]}}
    monkeypatch.setattr(gpu_suite_rl, "_build_llava", lambda directory, texts, ctx: "llava")
    monkeypatch.setattr(gpu_suite_rl, "_build_llama_7b", lambda directory, texts, device: "llama")
    monkeypatch.setattr(gpu_suite_rl, "need", lambda *a, **kw: None)
    ctx = gpu_suite_report.Context(tiny, "cuda", gpu_suite_report.Budget(10_000), tmp_path)
    section = gpu_suite_report.Section("rl", "RL")
    gpu_suite_rl._part_rl(ctx, section, rl_step, {"ppo": runner("ppo"), "grpo": runner("grpo")},
                          lambda root, args: assets, None, lambda device: None)
    policies = ("llava", "tiny-policy") if tiny else ("llava", "llama")
    assert set(seen) == {f"{p} {a}" for p in policies for a in ("ppo", "grpo")}, section.lines
    for rewards, weights in seen.values():
        assert rewards == ["dhm", "bleu"]
        assert weights == (None if tiny else [0.0, 1.0])


def test_quick_rl_runs_one_ppo_epoch_with_the_rewards_in_the_precision(tmp_path, monkeypatch):
    """--quick's estimates assume one PPO epoch per rollout (the full run
    takes 4), and --precision reaches the dhm reward's models in the rl part
    as it reaches the policy (the note says so)."""
    import rl_step

    seen = []

    def runner(assets, args, reward, out, prepare=False):
        seen.append((args.ppo_epochs, assets["rewards"]["dhm"]))
        assert (args.max_new_tokens, args.generate_repeats) == (24 if quick else 64, 1)
        raise RuntimeError("recorded")

    spec = {"reward": "dhm", "rewards": {"grounding": {"clip_model": "c"}, "coherence": {"model": "m"}}}
    monkeypatch.setattr(gpu_suite_rl, "_build_llava", lambda directory, texts, ctx: "llava")
    monkeypatch.setattr(gpu_suite_rl, "_build_llama_7b", lambda directory, texts, device: "llama")
    monkeypatch.setattr(gpu_suite_rl, "need", lambda *a, **kw: None)
    for quick, epochs in ((True, 1), (False, 4)):
        seen.clear()
        ctx = gpu_suite_report.Context(False, "cuda", gpu_suite_report.Budget(10_000), tmp_path / str(quick),
                                       quick=quick, precision="bf16")
        runners = {"ppo": runner, "grpo": runner, "rloo": runner}
        gpu_suite_rl._part_rl(ctx, gpu_suite_report.Section("rl", "RL"), rl_step, runners,
                              lambda root, args: {"data": "d", "policy": "p", "rewards": {"dhm": [spec]}}, None,
                              lambda device: None)
        assert len(seen) == (4 if quick else 6)  # 2 models x PPO, GRPO (and RLOO at full size)
        for ppo_epochs, rewards in seen:
            assert ppo_epochs == epochs
            assert [c["precision"] for c in rewards[0]["rewards"].values()] == ["bf16", "bf16"]
        assert spec["rewards"]["grounding"] == {"clip_model": "c"}  # the assets' own spec left as it was


def test_generate_4bit_computes_in_half_precision():
    """The 4-bit row computes in the --precision dtype, in fp16 when that is
    fp32 (its figures stay comparable with the documented NF4 ones)."""
    assert gpu_suite_parts.generate_variants("fp32") == [("fp32", "fp32", False), ("4-bit NF4", "fp16", True)]
    assert gpu_suite_parts.generate_variants("bf16") == [("bf16", "bf16", False), ("4-bit NF4", "bf16", True)]
    assert gpu_suite_parts.generate_variants("fp16") == [("fp16", "fp16", False), ("4-bit NF4", "fp16", True)]


def test_quick_mode_line_sums_the_chosen_parts():
    parts = SimpleNamespace(tiny=False, quick=True, parts=["rl", "pairs"])
    total = (gpu_suite_report.QUICK_PARTS["rl"] + gpu_suite_report.QUICK_PARTS["pairs"]) / 60
    assert f"add up to {total:.1f} min" in gpu_suite.mode_line(parts)
    everything = SimpleNamespace(tiny=False, quick=True, parts=list(gpu_suite_report.QUICK_PARTS))
    assert f"add up to {sum(gpu_suite_report.QUICK_PARTS.values()) / 60:.1f} min" in gpu_suite.mode_line(everything)


def test_recorded_policy_dtypes_restores_load_policy():
    import storyrl.training.storyteller.rl.policy as policy_module

    original = policy_module.load_policy
    found: list = []
    with gpu_suite_rl.recorded_policy_dtypes(found):
        assert policy_module.load_policy is not original
    assert policy_module.load_policy is original
    with pytest.raises(RuntimeError), gpu_suite_rl.recorded_policy_dtypes(found):
        raise RuntimeError("a failed row")
    assert policy_module.load_policy is original
