"""``storyrl kl`` and storyrl.eval.story_kl: the KL of a storyteller to its
start along its own stories, against a plainly written per-story loop
(full logits, no padding, float64), on tiny LLaVA-NeXT models."""

from __future__ import annotations

import copy
import inspect
import json
import math
import shutil

import pytest
from click.testing import CliRunner
from test_documented_path import write_vist_sis

import storyrl  # noqa: F401  (torchvision fallback before transformers)
from storyrl.cli import main

TEXTS = ["a dog ran to the park .", "the cat sat on a red mat .", "we went home and slept .", "[INST] [/INST]",
         "Output a story about this sequence of images using only five sentences. Make sure the story does not "
         "include more than five sentences."]
STORIES = ["a dog ran .", "the cat sat on a red mat . we went home and slept .", "", "dog dog dog dog dog ."]

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    from tiny_models import save_tiny_vlm

    root = tmp_path_factory.mktemp("kl_vlms")
    return [save_tiny_vlm(root / f"vlm{seed}", "llava_next", TEXTS, seed=seed) for seed in (0, 1)]


def load(directory):
    from storyrl.models.vlm import load_vlm

    return load_vlm(directory, None, "cpu", "fp32")


def reference_kl(policy, reference, processor, prompt: str, image, story: str) -> float:
    """One story at a time: the prompt's tokens counted alone, the whole
    sequence + EOS read by both models, KL(p || q) of every next-token
    distribution that predicts a story token (EOS included), in float64."""
    import torch

    eos = processor.tokenizer.eos_token_id
    prompt_ids = processor(images=[image], text=[prompt], return_tensors="pt")["input_ids"][0]
    full = processor(images=[image], text=[f"{prompt} {story}"], return_tensors="pt")
    ids = torch.cat([full["input_ids"][0], torch.tensor([eos])])[None]
    assert torch.equal(ids[0, : len(prompt_ids)], prompt_ids)  # the prompt's tokens do not change
    extra = {k: v for k, v in full.items() if k not in ("input_ids", "attention_mask")}
    total = 0.0
    with torch.no_grad():
        p = torch.softmax(policy(input_ids=ids, **extra).logits[0].double(), -1)
        q = torch.softmax(reference(input_ids=ids, **extra).logits[0].double(), -1)
    for t in range(len(prompt_ids), ids.shape[1]):  # token t is predicted at position t - 1
        total += float(sum(p[t - 1, v] * math.log(p[t - 1, v] / q[t - 1, v]) for v in range(p.shape[1])))
    return total


def inputs(n: int):
    from PIL import Image

    from storyrl.generators.prompts import mistral_inst

    prompt = mistral_inst(TEXTS[-1])
    images = [Image.new("RGB", (40 + 8 * k, 24), (30 * k, 90, 200 - 20 * k)) for k in range(n)]
    return [prompt] * n, images


@pytest.mark.parametrize("batch_size", [1, 3])
def test_sequence_kl_equals_a_plain_per_story_loop(vlms, batch_size):
    from storyrl.eval.story_kl import sequence_kl

    policy, start = load(vlms[0]), load(vlms[1])
    prompts, images = inputs(len(STORIES))
    got = sequence_kl(policy.model, start.model, policy.processor, prompts, images, STORIES, batch_size=batch_size)
    want = [reference_kl(policy.model, start.model, policy.processor, p, i, s)
            for p, i, s in zip(prompts, images, STORIES)]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert all(v > 0 for v in got)
    assert got[1] > got[0]  # a longer story sums over more tokens
    same = sequence_kl(policy.model, policy.model, policy.processor, prompts, images, STORIES, batch_size=batch_size)
    assert same == [0.0] * len(STORIES)


def test_sequence_kl_at_bf16_is_close_to_fp32(vlms):
    from storyrl.eval.story_kl import sequence_kl
    from storyrl.models.vlm import load_vlm

    prompts, images = inputs(2)
    fp32 = sequence_kl(load(vlms[0]).model, load(vlms[1]).model, load(vlms[0]).processor, prompts, images,
                       STORIES[:2])
    low = [load_vlm(v, None, "cpu", "bf16") for v in vlms]
    assert low[0].model.dtype.is_floating_point and str(low[0].model.dtype) == "torch.bfloat16"
    bf16 = sequence_kl(low[0].model, low[1].model, low[0].processor, prompts, images, STORIES[:2])
    assert bf16 == pytest.approx(fp32, rel=0.1, abs=0.05)


def test_sequence_kl_refuses_what_it_cannot_measure(vlms):
    from storyrl.eval.story_kl import sequence_kl

    vlm = load(vlms[0])
    prompts, images = inputs(1)
    with pytest.raises(ValueError, match="as many"):
        sequence_kl(vlm.model, vlm.model, vlm.processor, prompts, images, STORIES)
    with pytest.raises(ValueError, match="batch_size"):
        sequence_kl(vlm.model, vlm.model, vlm.processor, prompts, images, STORIES[:1], batch_size=0)
    right = copy.deepcopy(vlm.processor)  # the rows' ends must line up: a right-padding tokenizer is refused
    right.tokenizer.padding_side = "right"
    with pytest.raises(ValueError, match="must pad on the left"):
        sequence_kl(vlm.model, vlm.model, right, prompts, images, STORIES[:1])
    no_eos = copy.deepcopy(vlm.processor)
    no_eos.tokenizer.eos_token = None
    assert no_eos.tokenizer.eos_token_id is None
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        sequence_kl(vlm.model, vlm.model, no_eos, prompts, images, STORIES[:1])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sequence_kl_in_half_precision_is_exact_on_the_models_logits(vlms, precision):
    """In bf16/fp16 the models' logits are rounded, but the KL of those logits is computed in float32: it equals
    the float64 loop on the same logits (upcast) to 1e-3, where softmax in half precision is 2-30% off."""
    from storyrl.eval.story_kl import sequence_kl
    from storyrl.models.vlm import load_vlm

    low = [load_vlm(v, None, "cpu", precision) for v in vlms]
    assert str(low[0].model.dtype) == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    prompts, images = inputs(3)
    got = sequence_kl(low[0].model, low[1].model, low[0].processor, prompts, images, STORIES[:3], batch_size=3)
    want = [reference_kl(low[0].model, low[1].model, low[0].processor, p, i, s)
            for p, i, s in zip(prompts, images, STORIES[:3])]
    assert got == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("meta, message", [
    ({"generator": "tapm", "options": {}}, "'tapm' generator"),
    ({"generator": "prompting", "options": {"setting": "prev_sentence"}}, "'prev_sentence' setting"),
])
def test_prompting_options_refuse_other_runs(meta, message):
    from storyrl.eval.story_kl import prompting_options

    with pytest.raises(ValueError, match=message):
        prompting_options(meta)
    ok = prompting_options({"generator": "prompting", "options": {"setting": "visual", "chat_format": "auto"},
                            "chat_format": "authors"})
    assert ok["chat_format"] == "authors"  # the format the run resolved


@pytest.fixture(scope="module")
def generated(vlms, tmp_path_factory):
    """A `storyrl generate` story file (and sidecar) of vlms[0] on a tiny VIST slice."""
    root = tmp_path_factory.mktemp("kl_run")
    write_vist_sis(root / "sis.json", root / "images", 3)
    out = root / "stories.json"
    result = CliRunner().invoke(main, ["generate", "--model", vlms[0], "--data", str(root / "sis.json"),
                                       "--image-root", str(root / "images"), "--max-new-tokens", "3",
                                       "--precision", "fp32", "--device", "cpu", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    stories = json.loads(out.read_text())
    assert not any("<image>" in s for s in stories.values())
    stories["2"] = "of <image> park"  # what KL cannot read: the processor would take it for an image
    out.write_text(json.dumps(stories))
    return root, out


def kl_cli(*args):
    return CliRunner().invoke(main, ["kl", *map(str, args)])


def rows(path) -> dict[str, float]:
    lines = path.read_text().splitlines()
    assert lines[0] == "story_id,kl"
    return {sid: float(v) if v else math.nan for sid, v in (line.split(",") for line in lines[1:])}


def test_the_command_rebuilds_the_prompts_from_the_sidecar(vlms, generated):
    """`storyrl kl STORIES --reference MODEL` gives, per story, sequence_kl
    of the prompt and sequence image the story was generated from."""
    from storyrl.datasets import load_records
    from storyrl.eval.story_kl import sequence_kl
    from storyrl.generators.prompting import PromptingGenerator
    from storyrl.images import resolve_images

    root, stories = generated
    out = root / "kl.csv"
    result = kl_cli(stories, "--reference", vlms[1], "-o", out, "-q", "--batch-size", 2)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["stories"] == 3 and summary["measured"] == 2
    assert summary["policy"] == vlms[0] and summary["reference"] == vlms[1]
    assert "1 stories not measured: the story contains the image token <image>" in result.stderr
    got = rows(out)
    assert math.isnan(got["2"])
    texts = json.loads(stories.read_text())
    records = load_records(root / "sis.json")
    generator = PromptingGenerator(model=vlms[0], image_root=str(root / "images"))
    prompts, images = [], []
    for r in records:
        seq = resolve_images(r.images, r.image_ids, str(root / "images"))
        prompts.append(generator.wrap(generator.prompt_text(len(seq))))
        images.append(generator._sequence_image(r, seq))
    assert generator.chat_format == "authors"
    want = sequence_kl(load(vlms[0]).model, load(vlms[1]).model, load(vlms[0]).processor, prompts, images,
                       [texts[r.story_id] for r in records])
    assert [got[r.story_id] for r in records] == pytest.approx(want, rel=1e-5, nan_ok=True)
    assert summary["mean_kl"] == pytest.approx(sum(want[:2]) / 2)

    # --reference the policy itself: 0; --policy another model: another KL
    zero = root / "zero.csv"
    assert kl_cli(stories, "--reference", vlms[0], "-o", zero, "-q").exit_code == 0
    assert [rows(zero)[k] for k in "01"] == [0.0, 0.0]
    swapped = root / "swapped.csv"
    assert kl_cli(stories, "--reference", vlms[0], "--policy", vlms[1], "-o", swapped, "-q").exit_code == 0
    assert all(rows(swapped)[k] > 0 and rows(swapped)[k] != got[k] for k in "01")


def test_resume_keeps_rows_and_outputs_are_guarded(vlms, generated):
    root, stories = generated
    out = root / "resume.csv"
    full = root / "full.csv"
    assert kl_cli(stories, "--reference", vlms[1], "-o", full, "-q").exit_code == 0
    lines = full.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")  # a run killed after its first row
    result = kl_cli(stories, "--reference", vlms[1], "-o", out, "-q", "--resume")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["stories"] == 2 and summary["resumed"] == 1  # rows kept from OUT, not rows measured now
    assert rows(out) == pytest.approx(rows(full), nan_ok=True)
    refused = kl_cli(stories, "--reference", vlms[1], "-o", out)
    assert refused.exit_code != 0 and "exists" in refused.output
    replaced = kl_cli(stories, "--reference", vlms[1], "-o", out, "-q", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert json.loads(replaced.stdout.strip().splitlines()[-1])["resumed"] == 0
    assert rows(out) == pytest.approx(rows(full), nan_ok=True)


def test_device_precision_and_batch_size_reach_both_models(vlms, generated, monkeypatch):
    """--device and --precision load both models (the reference too) as asked; the inputs go to the policy's
    device; --batch-size is the stories per forward pass. Seen by a spy around sequence_kl."""
    import torch

    import storyrl.eval.story_kl as module

    real, calls = module.sequence_kl, []

    def spy(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        calls.append({"policy": a["policy"].dtype, "reference": a["reference"].dtype, "device": a["device"],
                      "batch_size": a["batch_size"], "stories": len(a["stories"])})
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "sequence_kl", spy)
    root, stories = generated
    out = root / "spied.csv"
    result = kl_cli(stories, "--reference", vlms[1], "-o", out, "-q", "--device", "cpu:0", "--precision", "bf16",
                    "--batch-size", 2)
    assert result.exit_code == 0, result.output
    assert [c["stories"] for c in calls] == [2, 1] and {c["batch_size"] for c in calls} == {2}
    for c in calls:
        assert c["policy"] == c["reference"] == torch.bfloat16
        assert torch.device(c["device"]) == torch.device("cpu", 0)  # cpu:0, not the default "cpu"
    assert all(math.isfinite(rows(out)[k]) for k in "01")


def copied_run(generated, directory, name: str, edit=None):
    """The generated story file and its sidecar under another name, the sidecar edited by ``edit(meta)``."""
    root, stories = generated
    target = directory / name
    shutil.copy(stories, target)
    meta = json.loads((root / "stories.meta.json").read_text())
    if edit is not None:
        edit(meta)
    (directory / f"{target.stem}.meta.json").write_text(json.dumps(meta))
    return target


def one_line_error(result, *parts):
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and all(p in errors[0] for p in parts), result.output


def test_option_and_input_errors_are_one_line_before_any_model(vlms, generated, tmp_path):
    root, stories = generated
    other = tmp_path / "other.json"  # records of other story ids: --data is read, not the sidecar's data file
    other.write_text(json.dumps({"x": "a story"}))
    one_line_error(kl_cli(stories, "--reference", vlms[1], "--data", other, "-o", tmp_path / "a.csv"),
                   "story '0' is not in the data (3 stories are not)")
    one_line_error(kl_cli(stories, "--reference", vlms[1], "--data-format", "vwp", "-o", tmp_path / "b.csv"),
                   "is not in the data")  # a VIST SIS file read as VWP holds none of the story ids
    one_line_error(kl_cli(stories, "--reference", vlms[1], "-o", tmp_path / "kl.txt"), "name it *.csv")
    assert not list(tmp_path.glob("[ab].csv")) and not (tmp_path / "kl.txt").exists()


def test_out_may_not_be_the_story_file(vlms, generated, tmp_path):
    """A story file named *.csv given as OUT too is refused, --overwrite or not."""
    stories = copied_run(generated, tmp_path, "stories.csv")
    before = stories.read_text()
    one_line_error(kl_cli(stories, "--reference", vlms[1], "-o", stories, "--overwrite"), "is also an input file")
    assert stories.read_text() == before


@pytest.mark.parametrize("key, value", [("options", [1]), ("inputs", ["sis.json"]), ("inputs", {"data": 5})])
def test_a_sidecar_of_the_wrong_shape_is_one_line(vlms, generated, tmp_path, key, value):
    stories = copied_run(generated, tmp_path, "s.json", lambda meta: meta.update({key: value}))
    one_line_error(kl_cli(stories, "--reference", vlms[1], "-o", tmp_path / "kl.csv"), "s.meta.json", key)


def test_a_type_error_while_loading_is_one_line(vlms, generated, tmp_path, monkeypatch):
    """A library's TypeError (e.g. a keyword an older transformers does not take) ends in one line, not a
    traceback."""
    import storyrl.models.vlm as vlm_module

    def old_library(*args, **kwargs):
        raise TypeError("__init__() got an unexpected keyword argument 'dtype'")

    monkeypatch.setattr(vlm_module, "_load", old_library)
    result = kl_cli(generated[1], "--reference", tmp_path / "never_loaded", "-o", tmp_path / "kl.csv", "-q")
    one_line_error(result, "unexpected keyword argument 'dtype'")
    # the command's own line: the CLI's last resort (an error no command expected) would add "TypeError: "
    assert "Error: __init__() got an unexpected keyword argument 'dtype'" in result.output.splitlines()


def test_a_story_file_without_its_sidecar_is_one_line(vlms, tmp_path):
    stories = tmp_path / "s.json"
    stories.write_text(json.dumps({"1": "a dog ran ."}))
    result = kl_cli(stories, "--reference", vlms[1], "-o", tmp_path / "kl.csv")
    assert result.exit_code != 0 and "s.meta.json: cannot read the sidecar" in result.output
    assert not (tmp_path / "kl.csv").exists()


def test_data_image_root_and_precision_options(vlms, generated):
    """--data/--image-root: other images for the same story ids change the
    KL; --precision bf16 stays close to the run's fp32."""
    import shutil

    from PIL import Image

    root, stories = generated
    base = root / "base.csv"
    assert kl_cli(stories, "--reference", vlms[1], "-o", base, "-q").exit_code == 0
    other = root / "other_images"
    shutil.copytree(root / "images", other)
    for path in other.glob("*.jpg"):
        Image.new("RGB", (32, 24), (250, 10, 10)).save(path)
    moved = root / "moved.csv"
    result = kl_cli(stories, "--reference", vlms[1], "--data", root / "sis.json", "--image-root", other, "-o", moved,
                    "-q")
    assert result.exit_code == 0, result.output
    assert all(rows(moved)[k] != pytest.approx(rows(base)[k]) for k in "01")
    low = root / "bf16.csv"
    result = kl_cli(stories, "--reference", vlms[1], "--precision", "bf16", "-o", low, "-q")
    assert result.exit_code == 0, result.output
    assert [rows(low)[k] for k in "01"] == pytest.approx([rows(base)[k] for k in "01"], rel=0.1, abs=0.05)
