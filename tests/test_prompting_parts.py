"""Zero-shot prompting parts (issue 10, first slice): the authors' prompts as
data, their unfilled placeholder, their post-processing, and their sequence
images rebuilt pixel for pixel."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO, shared_path
from storyrl.generators.postprocess import clean_generation, join_sentence_outputs
from storyrl.generators.prompts import count_word, load_prompts, mistral_inst
from storyrl.generators.sequence_image import BORDER, sequence_image

PROMPTS = REPO / "configs" / "prompts" / "dhm.yaml"


@pytest.mark.parametrize("name, n_images", [("vist/49620.png", 5), ("vwp/seq_tt0104348_0007_6_2.png", 5)])
def test_sequence_image_rebuilds_the_authors_png(name, n_images):
    from PIL import Image

    authors = Image.open(shared_path("dhm", *name.split("/"))).convert("RGB")
    cell = authors.width // n_images
    assert cell * n_images == authors.width
    # Each cell is one image inside a 2-pixel white frame.
    images = [authors.crop((k * cell + BORDER, BORDER, (k + 1) * cell - BORDER, authors.height - BORDER))
              for k in range(n_images)]
    rebuilt = sequence_image(images)
    assert rebuilt.size == authors.size
    assert np.array_equal(np.asarray(rebuilt), np.asarray(authors))
    # Resizing to the VIST size keeps the layout: 5 x (256 + 4) by 260.
    assert sequence_image(images, size=(256, 256)).size == (1300, 260)


def test_images_of_different_heights_are_top_aligned_on_white():
    from PIL import Image

    out = sequence_image([Image.new("RGB", (4, 4), "red"), Image.new("RGB", (2, 8), "blue")], border=1)
    a = np.asarray(out)
    assert out.size == (6 + 4, 10)
    assert tuple(a[1, 1]) == (255, 0, 0) and tuple(a[8, 1]) == (255, 255, 255) and tuple(a[8, 7]) == (0, 0, 255)
    with pytest.raises(ValueError, match="at least one image"):
        sequence_image([])


def test_the_papers_prompts_render_as_the_authors_sent_them():
    prompts = load_prompts(PROMPTS)
    assert sorted(prompts) == [(k, p) for k in ("sentence", "visual") for p in ("P1", "P2", "P3")]
    p3 = prompts[("visual", "P3")]
    # The string of the reference notes, with the placeholder the authors left in.
    assert mistral_inst(p3.render(fill_count=False)) == (
        "[INST] <image>\nOutput a story about this sequence of images using only N sentences. "
        "Make sure the story does not include more than N sentences. [/INST]"
    )
    assert p3.render(5) == ("Output a story about this sequence of images using only five sentences. "
                            "Make sure the story does not include more than five sentences.")
    assert prompts[("sentence", "P1")].render(context="The dog ran.") == (
        'Using this image, add one sentence to the following story: "The dog ran.<s>"'
    )
    assert prompts[("sentence", "P3")].render() == 'Add one sentence based on this image to the following story: "<s>"'
    with pytest.raises(ValueError, match="needs the sentence count"):
        p3.render()
    assert [count_word(n) for n in (1, 5, 12, 25)] == ["one", "five", "twelve", "25"]


@pytest.mark.parametrize(
    "text, fault",
    [
        ("prompts: {}\n", "'prompts' list"),
        ("prompts:\n  - {name: P1, kind: visual}\n", "prompt 1: expected exactly the keys"),
        ("prompts:\n  - {name: P1, kind: audio, text: x}\n", "prompt 1: kind must be one of"),
        ("prompts:\n  - {name: P1, kind: visual, text: 'use {context}'}\n", "prompt 1: a visual prompt uses exactly {n}"),
        ("prompts:\n  - {name: P1, kind: visual, text: 'use {n'}\n", "prompt 1: bad placeholder"),
        ("prompts:\n  - {name: P1, kind: visual, text: '{n}'}\n  - {name: P1, kind: visual, text: '{n}!'}\n",
         "prompt 2: a visual prompt named 'P1' is already defined"),
    ],
)
def test_bad_prompt_files_name_the_file_and_entry(tmp_path, text, fault):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path}: .*"):
        load_prompts(path)
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    assert fault in str(info.value)


def test_post_processing_as_the_authors():
    decoded = "[INST] \nWrite a story. [/INST] Caf\u00e9 time.\n\nThe f\u00eate began.\n"
    assert clean_generation(decoded) == "Cafe time. The fete began."
    assert clean_generation("[/INST] a\n \nb") == "a b"  # a blank line may hold spaces
    assert clean_generation("no marker at all") == "no marker at all"
    assert join_sentence_outputs(' "The dog ran."  A cat sat. ') == "The dog ran . A cat sat ."
    assert join_sentence_outputs(' "" . ') == ""
