"""Zero-shot prompting (issue 10 part 1) with tiny random-weight VLMs built
here: the prompts every setting sends (against the templates written in the
reference notes), the authors' decoding redone by hand with transformers,
batched = one by one, failures, resumable story files and ``storyrl
generate``."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest

from conftest import REPO
from tiny_models import save_tiny_vlm, write_images

from storyrl.data import StoryRecord
from storyrl.generators import create_generator
from storyrl.generators.postprocess import join_sentence_outputs
from storyrl.generators.prompting import SETTINGS
from storyrl.generators.runs import generate_to_file, sidecar_path

NOTES = REPO.parent / "shared" / "docs" / "reference-notes.md"
VOCAB = [
    (REPO / "configs" / "prompts" / "dhm.yaml").read_text(),
    "[INST] [/INST] <s> The dog ran home . A cat sat . \"quoted\" five four three two",
]


def _notes_templates() -> dict[tuple[str, str], str]:
    """The six prompts as the reference notes write them (``\\n`` as a newline)."""
    if not NOTES.is_file():
        pytest.skip(f"reference notes not available: {NOTES}")
    section = NOTES.read_text().split("## Zero-shot prompting", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^\s*(P[123]) `(.+)`$", section, flags=re.M)
    assert len(found) == 6, found
    kinds = ["visual"] * 3 + ["sentence"] * 3
    return {(kind, name): text.replace("\\n", "\n") for kind, (name, text) in zip(kinds, found)}


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {family: save_tiny_vlm(root / family, family, VOCAB) for family in ("llava_next", "llava", "blip2")}


@pytest.fixture(scope="module")
def square_images(tmp_path_factory):
    return [str(p) for p in write_images(tmp_path_factory.mktemp("img"), n=5, size=(32, 32))]


def _records(images, lengths=(5, 3, 4)):
    return [StoryRecord(f"s{i}", "a human story .", images=images[:n]) for i, n in enumerate(lengths)]


def _prompting(model, **options):
    options.setdefault("sequence_image_size", "12x12")  # 5 framed 12x12 images: a shape tiny LLaVA-NeXT accepts
    return create_generator("prompting", model=model, device="cpu", max_new_tokens=6, **options).setup()


def _spy(generator) -> list[tuple[str, tuple[int, int], bool]]:
    """Record every (prompt, image size, decode_prompt) the real engine is given."""
    calls = []
    engine = generator._engine
    original = engine.generate

    def generate(prompts, images, decode_prompt=False):
        calls.extend((p, im.size, decode_prompt) for p, im in zip(prompts, images))
        return original(prompts, images, decode_prompt)

    engine.generate = generate
    return calls


@pytest.mark.parametrize("prompt", ["P1", "P2", "P3"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_prompts_sent_match_the_reference_notes(vlm_dirs, square_images, setting, prompt):
    notes = _notes_templates()
    gen = _prompting(vlm_dirs["llava_next"], setting=setting, prompt=prompt, batch_size=2)
    calls = _spy(gen)
    records = _records(square_images, lengths=(5, 3))
    out = gen.generate(records)
    assert not out.failures
    if setting == "visual":
        # One call per story: the whole sequence (n framed 12x12 images) and the count as a word.
        expected = [re.sub(r"\bN\b", word, notes[("visual", prompt)]) for word in ("five", "three")]
        assert [c[0] for c in calls] == expected
        assert [c[1] for c in calls] == [(5 * 16, 16), (3 * 16, 16)]
        return
    # One call per image, position by position across the batch; the context
    # is what the model generated before for that story.
    assert len(calls) == 5 + 3
    template = notes[("sentence", prompt)]
    # Calls: s0 and s1 at positions 0-2, then s0 alone at 3 and 4.
    per_story = {0: [calls[i] for i in (0, 2, 4, 6, 7)], 1: [calls[i] for i in (1, 3, 5)]}
    for k, story_calls in per_story.items():
        outputs = []
        for i, (text, size, _) in enumerate(story_calls):
            assert size == (32, 32)  # the image itself
            if setting == "no_context" or i == 0:
                context = ""
            elif setting == "prev_sentence":
                context = outputs[-1]
            else:
                context = " ".join(outputs)
            assert text == template.replace("{context}", context)
            outputs.append(_authors_decode(gen, text, square_images[i]))
        assert out.stories[f"s{k}"] == join_sentence_outputs(" ".join(outputs))


def _authors_decode(gen, prompt, image_path):
    """The authors' pipeline for one call, written out with transformers:
    greedy, decode the whole sequence skipping special tokens, keep the text
    after the last [/INST], é/ê -> e, blank lines -> space."""
    from PIL import Image

    vlm = gen._engine.vlm
    inputs = vlm.processor(images=[Image.open(image_path).convert("RGB")], text=[prompt], return_tensors="pt")
    ids = vlm.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    decoded = vlm.tokenizer.decode(ids[0], skip_special_tokens=True)
    return decoded.rsplit("[/INST]", 1)[-1].replace("é", "e").replace("ê", "e").strip()


def test_authors_unfilled_placeholder_and_chat_formats(vlm_dirs, square_images):
    gen = _prompting(vlm_dirs["llava_next"], fill_count=False)
    calls = _spy(gen)
    gen.generate(_records(square_images, lengths=(5,)))
    assert gen.chat_format == "authors"
    assert calls[0][0] == _notes_templates()[("visual", "P3")]  # "N" exactly as the authors sent it
    assert calls[0][2] is True  # decoded with the prompt, cut after the last [/INST], as theirs
    full = gen._engine.generate([calls[0][0]], [gen._sequence_image(None, square_images)], decode_prompt=True)
    assert full[0].startswith("[INST] ") and "[/INST]" in full[0]  # the prompt decoded too
    llava = _prompting(vlm_dirs["llava"], setting="no_context")
    assert llava.chat_format == "template"  # LLaVA 1.5's chat template, from its processor
    llava_calls = _spy(llava)
    llava.generate(_records(square_images, lengths=(1,)))
    assert llava_calls[0][2] is False  # other formats: the new tokens only
    assert llava.wrap("Hi .") == "USER: <image>\nHi . ASSISTANT:"
    blip = _prompting(vlm_dirs["blip2"], setting="no_context")
    assert blip.chat_format == "plain" and blip.wrap("Hi .") == "Hi ."
    meta = gen.metadata()
    assert meta["chat_format"] == "authors" and meta["options"]["fill_count"] is False
    assert meta["prompt_example"].startswith("[INST] <image>\nOutput a story") and "only N sentences" in meta["prompt_example"]


@pytest.mark.parametrize("family", ["llava_next", "llava", "blip2"])
@pytest.mark.parametrize("setting", ["visual", "all_sentences"])
def test_batched_generation_equals_one_by_one(vlm_dirs, square_images, family, setting):
    records = _records(square_images, lengths=(5, 3, 4, 2))
    batched = _prompting(vlm_dirs[family], setting=setting, batch_size=4)
    calls = _spy(batched)
    together = batched.generate(records)
    assert len(calls) == (4 if setting == "visual" else 14)
    alone = _prompting(vlm_dirs[family], setting=setting, batch_size=1).generate(records)
    assert not together.failures and together.stories == alone.stories
    assert all(together.stories.values())


def test_visual_setting_matches_the_authors_decoding(vlm_dirs, square_images, tmp_path):
    from storyrl.generators.sequence_image import sequence_image

    gen = _prompting(vlm_dirs["llava_next"], batch_size=3)
    records = _records(square_images)
    out = gen.generate(records)
    for record in records:
        seq = sequence_image(record.images, size=(12, 12))
        seq.save(tmp_path / f"{record.story_id}.png")
        prompt = f"[INST] <image>\n{gen.prompt_text(len(record.images))} [/INST]"
        assert out.stories[record.story_id] == _authors_decode(gen, prompt, tmp_path / f"{record.story_id}.png")
    # Ready sequence images (the authors' PNGs) are used as given.
    given = _prompting(vlm_dirs["llava_next"], batch_size=3, sequence_image_dir=str(tmp_path),
                       sequence_image_size=None)
    assert given.generate(records).stories == out.stories


def test_a_failing_story_is_recorded_and_the_rest_finish(vlm_dirs, square_images, tmp_path):
    records = _records(square_images)
    records.insert(1, StoryRecord("broken", "x", images=[square_images[0], str(tmp_path / "missing.png")]))
    out = _prompting(vlm_dirs["llava_next"], setting="prev_sentence", batch_size=4).generate(records)
    assert set(out.stories) == {"s0", "s1", "s2"}
    assert list(out.failures) == ["broken"] and "missing.png" in out.failures["broken"]
    assert "N/A" not in out.stories.values()


def test_options_are_validated(vlm_dirs):
    with pytest.raises(ValueError, match="no visual prompt named 'P9'"):
        create_generator("prompting", model=vlm_dirs["llava"], prompt="P9")
    with pytest.raises(ValueError, match="sequence_image_size must look like 256x256"):
        create_generator("prompting", model=vlm_dirs["llava"], sequence_image_size="256")
    with pytest.raises(TypeError, match="max_new_tokens"):
        create_generator("prompting", model=vlm_dirs["llava"], max_new_tokens="500")
    with pytest.raises(ValueError, match="load_in_4bit needs a CUDA device"):
        create_generator("prompting", model=vlm_dirs["llava"], device="cpu", load_in_4bit=True).setup()


def test_vllm_backend_requests(monkeypatch, vlm_dirs, square_images):
    """The vLLM engine's requests and sampling parameters, through a stand-in
    ``vllm`` module (vLLM needs CUDA): greedy is temperature 0; the prompt
    and the image go in one request per call."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ValueError, match="needs vLLM"):
        _prompting(vlm_dirs["llava_next"], backend="vllm")

    seen = {}

    class LLM:
        def __init__(self, **options):
            seen["options"] = options

        def generate(self, requests, params, use_tqdm=False):
            seen["requests"], seen["params"] = requests, params
            out = types.SimpleNamespace(text=" A story .\n\nThe end .")
            return [types.SimpleNamespace(outputs=[out]) for _ in requests]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=types.SimpleNamespace))
    gen = _prompting(vlm_dirs["llava_next"], backend="vllm", precision="fp16")
    out = gen.generate(_records(square_images, lengths=(5,)))
    assert out.stories == {"s0": "A story . The end ."}
    assert seen["options"]["model"] == vlm_dirs["llava_next"] and seen["options"]["dtype"] == "float16"
    assert seen["params"].temperature == 0.0 and seen["params"].max_tokens == 6
    (request,) = seen["requests"]
    assert request["prompt"].startswith("[INST] <image>\nOutput a story") and request["multi_modal_data"]["image"].size == (80, 16)


# -- story files: sidecar, resume ---------------------------------------------------


def test_story_file_sidecar_and_resume_after_an_interrupted_run(vlm_dirs, square_images, tmp_path):
    records = _records(square_images, lengths=(5, 3, 4, 2, 5))
    out = tmp_path / "stories.json"
    gen = _prompting(vlm_dirs["llava_next"], batch_size=2)
    reference = gen.generate(records).stories

    batches = []
    original = gen._generate_batch

    def interrupted(batch):
        batches.append([r.story_id for r in batch])
        if len(batches) == 2:
            raise KeyboardInterrupt  # a kill in the second batch
        return original(batch)

    gen._generate_batch = interrupted
    with pytest.raises(KeyboardInterrupt):
        generate_to_file(gen, records, out, progress=False)
    assert json.loads(out.read_text()) == {k: reference[k] for k in ("s0", "s1")}
    assert json.loads(sidecar_path(out).read_text())["complete"] is False

    batches.clear()
    gen._generate_batch = lambda batch: batches.append([r.story_id for r in batch]) or original(batch)
    run = generate_to_file(gen, records, out, resume=True, progress=False, inputs={"data": "d.jsonl"})
    assert batches == [["s2", "s3"], ["s4"]]  # finished stories are not generated again
    assert run.resumed == 2 and json.loads(out.read_text()) == reference
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["complete"] is True and meta["counts"] == {"records": 5, "stories": 5, "failures": 0}
    assert meta["options"]["setting"] == "visual" and meta["options"]["max_new_tokens"] == 6
    assert meta["prompt_template"].startswith("Output a story") and meta["inputs"] == {"data": "d.jsonl"}

    with pytest.raises(Exception, match="exists"):
        generate_to_file(gen, records, out, progress=False)
    other = _prompting(vlm_dirs["llava_next"], prompt="P1")
    with pytest.raises(ValueError, match="generated with prompt='P3', this run has prompt='P1'"):
        generate_to_file(other, records, out, resume=True, progress=False)


# -- storyrl generate -----------------------------------------------------------------


def _cli(*args):
    from click.testing import CliRunner

    from storyrl.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_generate_command_end_to_end(vlm_dirs, square_images, tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    for k, path in enumerate(square_images[:4]):
        (root / f"{k}.png").write_bytes(open(path, "rb").read())
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{i}", "story": "x .", "image_ids": ["0", "1", "2", "3"][: 2 + i]})
                            + "\n" for i in range(3)))
    out = tmp_path / "stories.json"
    args = ["generate", "--model", vlm_dirs["llava_next"], "--setting", "prev_sentence", "--prompt", "P2",
            "--data", str(data), "--image-root", str(root), "--out", str(out), "--device", "cpu",
            "--max-new-tokens", "5", "--quiet"]
    result = _cli(*args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["stories"] == 3 and summary["failures"] == 0
    stories = json.loads(out.read_text())
    assert list(stories) == ["s0", "s1", "s2"] and all(s.endswith(" .") for s in stories.values())
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["options"]["prompt"] == "P2" and meta["options"]["setting"] == "prev_sentence"
    assert meta["model_commit"] is None and meta["chat_format"] == "authors"

    assert _cli(*args).exit_code != 0  # exists: --resume or --overwrite
    again = _cli(*args, "--resume")
    assert again.exit_code == 0 and json.loads(again.stdout)["resumed"] == 3

    # Every story failing (no image root): failures listed, nothing written as text, non-zero exit.
    bad = _cli("generate", "--model", vlm_dirs["llava_next"], "--data", str(data), "--out", str(tmp_path / "none.json"),
               "--device", "cpu", "--quiet")
    assert bad.exit_code != 0 and "no story was generated" in bad.output
    assert json.loads((tmp_path / "none.json").read_text()) == {}
    assert len(json.loads((tmp_path / "none.meta.json").read_text())["failures"]) == 3


def test_generate_command_errors(vlm_dirs, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"story_id": "s", "story": "x", "image_ids": ["0"]}) + "\n")
    result = _cli("generate", "--model", vlm_dirs["llava"], "--data", str(data), "--out", str(tmp_path / "o.txt"))
    assert result.exit_code != 0 and "story files are JSON" in result.output
    result = _cli("generate", "--model", vlm_dirs["llava"], "--data", str(data), "--out", str(tmp_path / "o.json"),
                  "--setting", "pictures")
    assert result.exit_code != 0 and "pictures" in result.output
    result = _cli("generate", "--model", vlm_dirs["llava"], "--data", str(data), "--out", str(tmp_path / "o.json"),
                  "--prompt", "P7")
    assert result.exit_code != 0 and "no visual prompt named 'P7'" in result.output
    result = _cli("generate", "--model", vlm_dirs["llava"], "--data", str(data), "--out", str(tmp_path / "o.json"),
                  "--tapm-max-new-tokens", "3")
    assert result.exit_code != 0 and "--tapm-max-new-tokens does not apply to the prompting generator" in result.output
    assert not (tmp_path / "o.json").exists()
