"""COSMiC: the RaCCoon loader (real file counted independently, malformed
files), the model (paper's parameter count, frozen cached encoders, timm and
open_clip towers), training on synthetic RaCCoon-format data, and the story
reward (independent per-sentence reference, batching, save/reload, NaN rules,
pickling, TRL contract). Tiny random encoders built here."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import REPO, shared_path
from tiny_models import albert_tokenizer, write_images

import storyrl  # noqa: F401  (before transformers on CPU-only torchvision)
from storyrl.judgements import JudgementDataError
from storyrl.judgements.raccoon import REQUIRED_COLUMNS, image_file_stem, load_raccoon
from storyrl.models.cosmic import CosmicHead, EncoderSpec, HeadConfig, cosmic_encoders
from storyrl.models.runtime import release_models
from storyrl.rewards import create_reward

pytestmark = pytest.mark.usefixtures("one_thread_module")

TINY_TIMM = {"layers": (1, 1, 1, 1), "channels": (8, 16, 32, 64), "stem_chs": 8}
WORDS = ("red dog ball park sky sea boat tree cat house road car beach sun rain snow bird hill "
         "river city photo taken at day night i love this view a the is of in on story old man")


# -- the real RaCCoon file -------------------------------------------------------


def test_raccoon_real_file_counts():
    path = shared_path("cosmic", "RaCCoon.tsv")
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    prefix = {"True": "Visible"}
    classes = Counter()
    broken = 0
    rated = Counter()
    ratings_sum = 0.0
    groups = {"Meta": {"cbMetaGood": 1.0, "cbMetaBad": 0.0}, "Subjective": {"cbSubjectiveGood": 1.0,
              "cbSubjectiveBad": 0.0}, "Visible": {f"cbVisible{r}": (r - 1) / 4 for r in range(1, 6)},
              "Story": {f"cbStory{r}": (r - 1) / 4 for r in range(1, 6)}}
    for row in rows:
        name = row["source"].rstrip("0123456789").rstrip("_")
        cls = prefix.get(name, name)
        classes[cls] += 1
        if row["cbBrokenImg"] == "1":
            broken += 1
            continue
        if cls in groups:
            ticks = [v for c, v in groups[cls].items() if row[c] == "1"]
            if len(ticks) == 1:
                rated[cls] += 1
                ratings_sum += ticks[0]
    data = load_raccoon(path)
    assert data.rows == len(rows) == 4245
    assert dict(data.classes) == dict(classes)
    assert data.classes == Counter(Meta=1025, Visible=997, Subjective=1040, Story=1020, Action=163)
    assert data.broken == broken == 162
    assert Counter(r.coherence for r in data.records) == rated
    assert sum(r.rating for r in data.records) == pytest.approx(ratings_sum)
    assert data.skipped["action"] == classes["Action"] - sum(
        1 for r in rows if r["source"].startswith("Action") and r["cbBrokenImg"] == "1")
    assert len(data.records) + data.broken + sum(data.skipped.values()) == data.rows
    assert all(0.0 <= r.rating <= 1.0 for r in data.records)
    visible = load_raccoon(path, action_ratings="visible")
    assert "action" not in visible.skipped and any(r.coherence == "Action" for r in visible.records)
    zero = load_raccoon(path, unrated="zero")
    assert "unrated" not in zero.skipped and len(zero.records) == len(data.records) + data.skipped["unrated"]


# -- synthetic RaCCoon-format files ------------------------------------------------


def _row(n, url, caption, source, rating_col=None, broken=False):
    row = {c: "0" for c in REQUIRED_COLUMNS}
    row.update(id_annotation=str(n), id_annotator="2", caption=caption, url=url, source=source)
    if broken:
        row["cbBrokenImg"] = "1"
    if rating_col:
        row[rating_col] = "1"
    return row


def _write_tsv(path, rows, columns=REQUIRED_COLUMNS):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("\t".join(columns) + "\n")
        for row in rows:
            f.write("\t".join(row.get(c, "0") for c in columns) + "\n")
    return path


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda r: r.update(cbVisible3="2"), "row 2: column 'cbVisible3': '2' is not 0 or 1"),
        (lambda r: r.update(source="Foo12"), "row 2: column 'source': 'Foo12'"),
        (lambda r: r.update(caption=" "), "row 2: column 'caption': empty"),
        (lambda r: r.update(url=""), "row 2: column 'url': empty"),
    ],
)
def test_raccoon_malformed_rows(tmp_path, change, expected):
    rows = [_row(1, "http://x/a.jpg", "a dog", "True1", "cbVisible5"), _row(2, "http://x/b.jpg", "a cat", "Meta_2")]
    change(rows[1])
    path = _write_tsv(tmp_path / "bad.tsv", rows)
    with pytest.raises(JudgementDataError) as err:
        load_raccoon(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith("bad.tsv: ") and expected in message


def test_raccoon_malformed_header_and_fields(tmp_path):
    path = _write_tsv(tmp_path / "cols.tsv", [], [c for c in REQUIRED_COLUMNS if c != "cbStory4"])
    with pytest.raises(JudgementDataError, match=r"^cols.tsv: missing column\(s\): cbStory4$"):
        load_raccoon(path)
    path = tmp_path / "short.tsv"
    _write_tsv(path, [_row(1, "u", "c", "Story1", "cbStory2")])
    path.write_text(path.read_text() + "7\t2\tonly three\n")
    with pytest.raises(JudgementDataError, match=r"^short.tsv: row 2: 3 fields for \d+ columns$"):
        load_raccoon(path)


def test_raccoon_ratings_and_images(tmp_path):
    urls = [f"http://img.example/{k}/photo.jpg" for k in range(3)]  # same basename: names by sha1
    rows = [
        _row(1, urls[0], "a red dog", "True1", "cbVisible4"),  # (4-1)/4
        _row(2, urls[0], "i love this", "Subjective2", "cbSubjectiveGood"),
        _row(3, urls[1], "photo taken at night", "Meta3", "cbMetaBad"),
        _row(4, urls[1], "the old man", "Story4", "cbStory1"),
        _row(5, urls[1], "broken one", "Story5", "cbStory5", broken=True),
        _row(6, urls[2], "no image file", "Story6", "cbStory3"),
        _row(7, urls[0], "unrated", "Story7", "cbVisible2"),  # rated on another class only
        _row(8, urls[0], "both", "Meta8", "cbMetaGood"),
        _row(9, urls[0], "running", "Action9", "cbVisible3"),
    ]
    rows[7]["cbMetaBad"] = "1"
    path = _write_tsv(tmp_path / "r.tsv", rows)
    files = write_images(tmp_path / "raw", n=2)
    folder = tmp_path / "by_sha1"
    folder.mkdir()
    for url, file in zip(urls, files):
        (folder / f"{hashlib.sha1(url.encode()).hexdigest()}.png").write_bytes(file.read_bytes())
    assert image_file_stem(urls[0]) == hashlib.sha1(urls[0].encode()).hexdigest()
    data = load_raccoon(path, image_dir=folder)
    assert [(r.row, r.coherence, r.rating) for r in data.records] == [
        (1, "Visible", 0.75), (2, "Subjective", 1.0), (3, "Meta", 0.0), (4, "Story", 0.0)]
    assert data.broken == 1 and data.skipped == Counter(
        {"missing image": 1, "unrated": 1, "conflicting": 1, "action": 1})
    assert data.records[0].image.endswith(".png")
    action = load_raccoon(path, image_dir=folder, action_ratings="visible")
    assert [(r.coherence, r.rating) for r in action.records if r.row == 9] == [("Action", 0.5)]
    # A URL -> file map, JSON and TSV, relative paths against the map's folder.
    (tmp_path / "map.json").write_text(json.dumps({urls[0]: "raw/img0.png", urls[2]: "raw/img1.png"}))
    (tmp_path / "map.tsv").write_text(f"url\tpath\n{urls[0]}\traw/img0.png\n{urls[2]}\traw/img1.png\n")
    for name in ("map.json", "map.tsv"):
        mapped = load_raccoon(path, image_map=tmp_path / name)
        assert [r.row for r in mapped.records] == [1, 2, 6]
        assert mapped.skipped["missing image"] == 2  # rows 3 and 4: url 1 is not in the map
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(JudgementDataError, match=r"^bad.json: an image map must be"):
        load_raccoon(path, image_map=tmp_path / "bad.json")


# -- tiny encoders ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from transformers import BertConfig, BertModel

    directory = tmp_path_factory.mktemp("bert")
    tokenizer = albert_tokenizer([WORDS])
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def timm_spec(tiny_bert):
    return EncoderSpec("timm", "resnetv2_50", None, tuple(TINY_TIMM.items()), tiny_bert, 32)


def test_head_has_the_papers_parameter_count():
    head = CosmicHead(HeadConfig(image_dim=2048, text_dim=1024))  # ResNet50V2 pooled, BERT-large
    assert sum(p.numel() for p in head.parameters()) == 3_062_913  # §5.1


@pytest.mark.parametrize("library", ["timm", "open_clip"])
def test_encoders_cache_and_stay_frozen(library, tiny_bert, tiny_clip, images):
    spec = timm_spec(tiny_bert) if library == "timm" else EncoderSpec("open_clip", tiny_clip, None, (), tiny_bert, 32)
    enc = cosmic_encoders(spec, "cpu", "fp32", batch_size=2)
    assert not any(p.requires_grad for p in [*enc.image_model.parameters(), *enc.text_model.parameters()])
    a = enc.embed_images([images[0], images[1], images[0]])
    b = enc.embed_images([images[1], images[2]])
    assert enc.stats["images_embedded"] == 3 and np.array_equal(a[1], b[0]) and np.array_equal(a[0], a[2])
    t = enc.embed_texts(["a red dog", "the sky", "a red dog"])
    assert enc.stats["texts_embedded"] == 2 and t.shape == (3, 16)
    # Independent [CLS]: the encoder run directly on one text.
    from transformers import AutoModel, AutoTokenizer

    tok, bert = AutoTokenizer.from_pretrained(tiny_bert), AutoModel.from_pretrained(tiny_bert).eval()
    with torch.no_grad():
        cls = bert(**tok("the sky", return_tensors="pt")).last_hidden_state[0, 0].numpy()
    np.testing.assert_allclose(t[1], cls, rtol=1e-5, atol=1e-6)


# -- training on synthetic RaCCoon-format data ------------------------------------------

CLASS_CAPTIONS = {
    "True": ["a red dog on the road", "a boat on the sea", "a bird in the tree", "a car in the city"],
    "Meta": ["photo taken at night", "photo taken at day", "photo of the city", "photo of the park"],
    "Subjective": ["i love this view", "i love this", "this is old", "i love the sun"],
    "Story": ["the old man is in the park", "the cat is on the house", "a man on the hill", "the rain in the city"],
}
RATING_COL = {"True": "cbVisible", "Story": "cbStory"}


@pytest.fixture(scope="module")
def raccoon_dir(tmp_path_factory):
    """8 images x 4 classes; a caption's rating depends on its class and image."""
    root = tmp_path_factory.mktemp("raccoon")
    files = write_images(root / "img", n=8)
    rows, n = [], 0
    for k, file in enumerate(files):
        url = f"http://img.example/{k}.jpg"
        for cls, caps in CLASS_CAPTIONS.items():
            n += 1
            good = (k + len(cls)) % 2 == 0
            if cls in RATING_COL:
                col = f"{RATING_COL[cls]}{5 if good else 2}"
            else:
                col = f"cb{cls}{'Good' if good else 'Bad'}"
            rows.append(_row(n, url, f"{caps[k % 4]} {k}", f"{cls}{n}", col))
    rows.append(_row(n + 1, "http://img.example/0.jpg", "broken", "Story99", "cbStory3", broken=True))
    rows.append(_row(n + 2, "http://img.example/missing.jpg", "lost", "Story98", "cbStory3"))
    path = _write_tsv(root / "raccoon.tsv", rows)
    (root / "map.tsv").write_text("url\tpath\n" + "".join(
        f"http://img.example/{k}.jpg\t{f}\n" for k, f in enumerate(files)))
    return root


def _train_config(root, tiny_bert, out, **extra):
    from storyrl.training.judges.cosmic import CosmicTrainConfig

    options = dict(output_dir=str(out), raccoon=str(root / "raccoon.tsv"), image_map=str(root / "map.tsv"),
                   image_library="timm", image_model="resnetv2_50", image_pretrained=None,
                   image_kwargs=dict(TINY_TIMM), text_model=tiny_bert, max_length=32, device="cpu",
                   precision="fp32", epochs=6, lr_decay=1.0, val_fraction=0.25, patience=10, seed=0)
    options.update(extra)
    return CosmicTrainConfig(**options)


@pytest.fixture(scope="module")
def trained(raccoon_dir, tiny_bert, tmp_path_factory):
    from storyrl.training import TRAINERS

    release_models()
    config = _train_config(raccoon_dir, tiny_bert, tmp_path_factory.mktemp("run"))
    encoders = cosmic_encoders(config.encoder_spec(), "cpu", "fp32")
    before = {k: v.clone() for k, v in [*encoders.image_model.state_dict().items(),
                                        *encoders.text_model.state_dict().items()]}
    result = TRAINERS.get("cosmic").train(config, progress=False)
    after = dict([*encoders.image_model.state_dict().items(), *encoders.text_model.state_dict().items()])
    return {"config": config, "result": result, "encoders": encoders, "before": before, "after": after}


def test_training_lowers_the_loss_and_counts(trained):
    result = trained["result"]
    history = result.history
    assert history[-1]["train_loss"] < history[0]["train_loss"] * 0.8
    data = result.data
    assert data["broken"] == 1 and data["skipped"]["missing image"] == 1
    assert data["examples"] == 32 and data["train"] + data["val"] == 32 and data["images"] == 8
    with open(f"{trained['config'].output_dir}/data_summary.json") as f:
        assert json.load(f) == data


def test_encoders_frozen_and_embedded_once(trained):
    assert trained["before"].keys() == trained["after"].keys()
    assert all(torch.equal(trained["before"][k], trained["after"][k]) for k in trained["before"])
    stats = trained["encoders"].stats
    assert stats["images_embedded"] == 8  # 8 distinct images, embedded once for all epochs
    assert stats["texts_embedded"] == 32  # 32 distinct captions (references are captions too)


def test_augmentation_and_unreadable_images(raccoon_dir, tiny_bert, tmp_path):
    from storyrl.training.judges.cosmic import train_cosmic

    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    lines = (raccoon_dir / "map.tsv").read_text().splitlines()
    lines[-1] = lines[-1].split("\t")[0] + f"\t{bad}"  # image 7 cannot be decoded
    (tmp_path / "map.tsv").write_text("\n".join(lines) + "\n")
    config = _train_config(raccoon_dir, tiny_bert, tmp_path / "plus", augment=2, epochs=1,
                           image_map=str(tmp_path / "map.tsv"))
    result = train_cosmic(config, progress=False)
    plain = result.data["train"] - result.data["augmented"]
    assert result.data["augmented"] == 2 * plain
    assert result.data["skipped"]["unreadable image"] == 4 and result.data["examples"] == 28


def test_reference_choice():
    from storyrl.judgements.raccoon import RaCCoonRecord
    from storyrl.training.judges.cosmic import build_examples

    def rec(row, caption, coherence, rating, url="u"):
        return RaCCoonRecord(str(row), "2", caption, url, coherence, f"x{row}", rating, None, row)

    records = [rec(1, "meta", "Meta", 1.0), rec(2, "vis low", "Visible", 0.25), rec(3, "vis high", "Visible", 0.75),
               rec(4, "story", "Story", 1.0), rec(5, "vis high", "Visible", 0.5), rec(6, "alone", "Story", 1.0, "v"),
               rec(7, "act", "Action", 1.0)]
    skipped = Counter()
    pairs = [(r.row, ref.row) for r, ref in build_examples(records, ["Meta", "Visible", "Subjective", "Story"], skipped)]
    # Visible first, then the highest rating, never the candidate's own text.
    assert pairs == [(1, 3), (2, 3), (3, 2), (4, 3), (5, 2)]
    assert skipped == Counter({"no reference": 1, "label Action not in labels": 1})


# -- the story reward ----------------------------------------------------------------


def _reward(trained, **options):
    return create_reward("cosmic", model=f"{trained['config'].output_dir}/best", device="cpu", precision="fp32",
                         **options)


STORIES = ["A red dog ran. The boat sailed. I love this view.", "The old man sat. Photo taken at night. A bird sang."]
REFS = ["A dog on the road. A boat on the sea. A tree in the park.", "A man in the park. The city at night. A bird."]


def _independent(trained, story, imgs, ref, cand_label="Story", ref_label="Story"):
    """Per-sentence scores from the encoders run directly, then the head."""
    import timm
    from timm.data import create_transform, resolve_data_config
    from PIL import Image
    from transformers import AutoModel, AutoTokenizer

    from storyrl.text import split_sentences

    torch.manual_seed(0)
    tower = timm.create_model("resnetv2_50", pretrained=False, num_classes=0, **TINY_TIMM).eval()
    transform = create_transform(**resolve_data_config({}, model=tower))
    tok = AutoTokenizer.from_pretrained(trained["config"].text_model)
    bert = AutoModel.from_pretrained(trained["config"].text_model).eval()
    head = CosmicHead.from_pretrained(f"{trained['config'].output_dir}/best")
    scores = []
    for img, sent, rsent in zip(imgs, split_sentences(story), split_sentences(ref), strict=True):
        with torch.no_grad():
            pixels = transform(Image.open(img).convert("RGB"))[None]
            e_img = tower(pixels)
            e_c = bert(**tok(sent, return_tensors="pt")).last_hidden_state[:, 0]
            e_r = bert(**tok(rsent, return_tensors="pt")).last_hidden_state[:, 0]
        scores.append(_head_by_hand(head, e_img, e_c, e_r, cand_label, ref_label))
    return float(np.mean(scores))


def _head_by_hand(head, e_img, e_c, e_r, cand_label, ref_label):
    """Eqs. 3-6 in numpy from the saved weights: shared Linear_2 / Linear_3, ReLU MLP, Linear_4."""
    w = {k: v.double().numpy() for k, v in head.state_dict().items()}
    lin = lambda x, name: x @ w[f"{name}.weight"].T + w[f"{name}.bias"]  # noqa: E731
    onehot = lambda label: np.eye(len(head.labels))[list(head.labels).index(label)][None]  # noqa: E731
    x = np.concatenate([lin(e_img.double().numpy(), "image_proj"), lin(e_c.double().numpy(), "text_proj"),
                        lin(e_r.double().numpy(), "text_proj"), lin(onehot(cand_label), "label_proj"),
                        lin(onehot(ref_label), "label_proj")], axis=1)
    linears = sorted({int(k.split(".")[1]) for k in w if k.startswith("mlp.")})
    assert len(linears) == 7  # 512, 256, ..., 8
    for i in linears:
        x = np.maximum(lin(x, f"mlp.{i}"), 0.0)
    return float(lin(x, "out")[0, 0])


def test_reward_equals_independent_mean(trained, images):
    reward = _reward(trained, image_pipeline="exact")  # the reference preprocesses with PIL
    got = reward.score(STORIES, images=[images, images[::-1]], reference=REFS)
    want = [_independent(trained, STORIES[0], images, REFS[0]), _independent(trained, STORIES[1], images[::-1], REFS[1])]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    visible = _reward(trained, reference_label="Visible", candidate_label="Meta", image_pipeline="exact")
    np.testing.assert_allclose(visible.score(STORIES[:1], images=[images], reference=REFS[:1]),
                               [_independent(trained, STORIES[0], images, REFS[0], "Meta", "Visible")], rtol=1e-4,
                               atol=1e-5)
    # A reference given as one sentence per image equals the split string.
    from storyrl.text import split_sentences

    listed = reward.score(STORIES, images=[images, images[::-1]], reference=[split_sentences(r) for r in REFS])
    np.testing.assert_array_equal(listed, got)


def test_reward_aligns_sentence_image_and_reference(trained, images, monkeypatch):
    from storyrl.models.cosmic import CosmicScorer

    seen = []
    original = CosmicScorer.score
    monkeypatch.setattr(CosmicScorer, "score",
                        lambda self, examples, *more: seen.extend(examples) or original(self, examples, *more))
    _reward(trained, reference_label="Visible").score(STORIES[:1], images=[images[::-1]], reference=REFS[:1])
    assert [(e.image, e.candidate, e.reference, e.candidate_label, e.reference_label) for e in seen] == [
        (images[2], "A red dog ran.", "A dog on the road.", "Story", "Visible"),
        (images[1], "The boat sailed.", "A boat on the sea.", "Story", "Visible"),
        (images[0], "I love this view.", "A tree in the park.", "Story", "Visible"),
    ]


def test_reward_batched_equals_one_by_one_and_reload(trained, images):
    reward = _reward(trained)
    stories = STORIES * 2
    imgs = [images, images[::-1], images[1:] + images[:1], images]
    refs = REFS + REFS[::-1]
    batched = reward.score(stories, images=imgs, reference=refs)
    single = [reward.score([s], images=[i], reference=[r])[0] for s, i, r in zip(stories, imgs, refs)]
    np.testing.assert_allclose(batched, single, rtol=1e-6, atol=1e-7)
    release_models()  # reload head and encoders from the directory and names
    again = _reward(trained).score(stories, images=imgs, reference=refs)
    np.testing.assert_array_equal(again, batched)


def test_reward_unscorable_cases(trained, images, tmp_path):
    reward = _reward(trained)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    scores = reward.score(
        ["A dog. A boat.", STORIES[0], STORIES[0], STORIES[0], STORIES[0]],
        images=[images, images, [images[0], str(tmp_path / "nope.png"), images[2]], [images[0], str(bad), images[2]],
                images],
        reference=[REFS[0], None, REFS[0], REFS[0], "Only one sentence."],
    )
    assert np.isnan(scores).all()
    reasons = reward.stats["reasons"]
    assert reasons["count mismatch"] == 2 and reasons["no reference"] == 1 and reasons["images"] == 2
    lenient = _reward(trained, count_mismatch="min", missing_reference="self")
    two = lenient.score(["A red dog ran. The boat sailed."], images=[images], reference=[REFS[0]])
    assert two[0] == pytest.approx(_independent(trained, "A red dog ran. The boat sailed.", images[:2],
                                                "A dog on the road. A boat on the sea."), rel=1e-4, abs=1e-5)
    selfref = lenient.score([STORIES[0]], images=[images])
    assert math.isfinite(selfref[0])



def test_a_lone_surrogate_in_the_reference_or_story_is_cleaned(trained, images):
    """The reference is cleaned as the story is (a lone surrogate, e.g. from a
    JSON "\\ud800" escape, used to make a valid story NaN)."""
    reward = _reward(trained)
    ref = REFS[0].replace("road", "road\ud800")
    story = STORIES[0].replace("dog", "dog\ud800")
    cleaned = REFS[0].replace("road", "road\ufffd")
    scores = reward.score([STORIES[0], story], images=[images, images], reference=[ref, REFS[0]])
    assert np.isfinite(scores).all()
    assert scores[0] == pytest.approx(reward.score([STORIES[0]], images=[images], reference=[cleaned])[0], abs=1e-6)
    listed = reward.score([STORIES[0]], images=[images], reference=[[s + "." for s in ref.split(". ")]])
    assert math.isfinite(listed[0])

def test_reward_pickle_trl_and_registry(trained, images):
    from storyrl.rewards import get_reward_class

    assert get_reward_class("cosmic").name == "cosmic"
    reward = _reward(trained)
    clone = pickle.loads(pickle.dumps(reward))
    want = reward.score(STORIES, images=[images, images], reference=REFS)
    np.testing.assert_array_equal(clone.score(STORIES, images=[images, images], reference=REFS), want)
    out = reward(prompts=["p", "p", "p"], completions=[*STORIES, "Just one."], story_images=[images] * 3,
                 reference=[*REFS, REFS[0]])
    assert out[:2] == pytest.approx(list(want)) and out[2] is None and reward.__name__ == "cosmic"
    with pytest.raises(Exception, match="not one of the model's"):
        _reward(trained, candidate_label="Action").score(STORIES[:1], images=[images], reference=REFS[:1])


def test_shipped_configs_load():
    from storyrl.rewards import load_reward_config
    from storyrl.training.judges.cosmic import CosmicTrainConfig

    config = CosmicTrainConfig.from_yaml(REPO / "configs/training/cosmic.yaml")
    assert (config.lr, config.batch_size, config.epochs) == (1e-3, 10, 100)
    assert config.lr_decay ** 10 == pytest.approx(0.01)
    reward = load_reward_config(REPO / "configs/rewards/cosmic.yaml")
    assert reward.candidate_label == "Story" and reward.count_mismatch == "nan"
