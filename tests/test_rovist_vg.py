"""RoViST-VG: formula and loss by hand, GloVe parsing, the reward against an
independent computation with a tiny random timm ViT (tests/tiny_models.py),
batching, failures, storage, pickling, and training through the generic loop."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from tiny_models import WORD_DIM, rovist_vg_model

import storyrl  # noqa: F401  (torchvision fallback before timm)
from storyrl.models.glove import load_glove
from storyrl.models.rovist_vg import RovistVGModel
from storyrl.rewards.rovist_vg import RovistVG, rovist_vg_score, scale_score

@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "stories.json"
    path.write_text('{"1": "the dog ran .", "2": "the sky was blue .", "3": "a dog and a car .", "4": "rain ."}')
    return str(path)


def make(model_dir, glove_path, **options) -> RovistVG:
    # CPU: fp32, comparable with the hand computations at 1e-5 also on GPU machines.
    return RovistVG(model=model_dir, glove=glove_path, **{"device": "cpu", **options})


# -- formula and loss by hand --------------------------------------------------------


def test_score_formula_by_hand():
    # log(exp(2 * 0.5) + exp(1 * -0.2))
    expected = math.log(math.exp(1.0) + math.exp(-0.2))
    assert rovist_vg_score([0.5, -0.2], [2.0, 1.0]) == pytest.approx(expected)
    assert rovist_vg_score([0.5, -0.2], [2.0, 1.0], scaled=True) == pytest.approx(
        2 / (1 + math.exp(-0.5 * expected)) - 1
    )
    assert scale_score(0.0) == 0.0 and -1 < scale_score(-50) < scale_score(50) < 1
    assert rovist_vg_score([0.3]) == pytest.approx(0.3)  # one noun, idf 1: log exp(x) = x
    assert rovist_vg_score([800.0, 799.0]) == pytest.approx(800 + math.log(1 + math.exp(-1)))  # no overflow
    assert math.isnan(rovist_vg_score([], []))


def test_loss_matches_hand_computation_on_2x2():
    import torch

    from storyrl.training.judges.rovist_vg import rovist_vg_loss

    image = np.array([[0.5, -0.3], [0.1, 0.8]])
    text = np.array([[0.4, 0.2], [-0.6, 0.7]])

    def log_softmax(x):
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    logits = text @ image.T
    labels = (image @ image.T + text @ text.T) / 2
    targets = np.exp(labels) / np.exp(labels).sum(axis=1, keepdims=True)  # softmax over label rows
    loss_text = np.mean(-(targets * log_softmax(logits)).sum(axis=1))
    loss_image = np.mean(-(targets.T * log_softmax(logits.T)).sum(axis=1))
    expected = (loss_image + loss_text) / 2

    got = rovist_vg_loss(torch.tensor(image, dtype=torch.float32), torch.tensor(text, dtype=torch.float32))
    assert got.item() == pytest.approx(expected, abs=1e-6)


# -- GloVe ---------------------------------------------------------------------------


def test_glove_parsing_and_phrase_vectors(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("dog 1 2 3\ncat 3 4 5\n. . . 9 9 9\ndog 7 7 7\nCar 0 0 1\n", encoding="utf-8")
    glove = load_glove(path)
    assert glove.dim == 3 and len(glove) == 4  # the repeated "dog": first wins
    assert glove.vector(". . .").tolist() == [9, 9, 9]  # words with spaces (glove.840B)
    assert glove.vector("DOG").tolist() == [1, 2, 3]  # looked up lower-cased
    assert glove.vector("car") is None  # only lower-case entries answer
    assert glove.phrase_vector("the Dog cat").tolist() == [2, 3, 4]  # mean of the words found
    assert glove.phrase_vector("unicorn") is None
    small = load_glove(path, vocabulary={"cat"})
    assert len(small) == 1 and small.vector("cat").tolist() == [3, 4, 5]
    header = tmp_path / "w2v.txt"
    header.write_text("2 3\ndog 1 2 3\ncat 3 4 5\n")
    assert len(load_glove(header)) == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dog 1 2 3\ncat 3 4\n", r"g\.txt, line 2: expected a word and 3 numbers"),
        ("dog 1 2 3\n\ncat 3 x 5\n", r"g\.txt, line 3: 'x' is not a number"),
        ("dog 1 2 nan\n", r"g\.txt, line 1: non-finite"),
        ("dog\n", r"g\.txt, line 1: expected a word followed by numbers"),
        ("", r"g\.txt: no word vectors"),
    ],
)
def test_glove_errors_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "g.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_glove(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_glove(tmp_path / "missing.txt")


# -- the reward vs an independent computation --------------------------------------------


def independent_rovist_vg(model_dir, glove_path, nouns, boxes_per_image, idf, scaled=False):
    """Eq. 2/3 step by step with the saved model used directly."""
    import torch
    from PIL import Image

    model = RovistVGModel.from_pretrained(model_dir)
    transform = model.image_transform()
    vectors = {}
    for line in Path(glove_path).read_text().splitlines():
        word, *values = line.split(" ")
        vectors[word] = np.array(values, dtype=np.float32)
    with torch.no_grad():
        t = model.embed_texts(torch.tensor(np.stack([vectors[n] for n in nouns])))
        crops = []
        for path, boxes in boxes_per_image:
            img = Image.open(path).convert("RGB")
            crops += [transform(img if box is None else img.crop(tuple(round(v) for v in box))) for box in boxes]
        v = model.embed_images(torch.stack(crops))
    t = t / t.norm(dim=-1, keepdim=True)
    v = v / v.norm(dim=-1, keepdim=True)
    best = (t @ v.T).max(dim=1).values.double().numpy()
    s = math.log(sum(math.exp(w * c) for w, c in zip(idf, best)))
    return (2 / (1 + math.exp(-0.5 * s)) - 1 if scaled else s), best


@pytest.fixture
def region_table(tmp_path):
    table = tmp_path / "regions.csv"
    boxes = {"img0": [[0.0, 0.0, 20.0, 20.0], [10.5, 5.2, 40.0, 38.0]], "img1": [[1, 2, 30, 30], [0, 0, 48, 40]]}
    with table.open("w") as fh:
        fh.write("image_name,image_id,bbox,object,score\n")
        for iid, bs in boxes.items():
            for b in bs:
                fh.write(f'{iid}.png,{iid},"[{b[0]}, {b[1]}, {b[2]}, {b[3]}]",thing,0.9\n')
    return str(table), boxes


@pytest.mark.parametrize("scaled", [False, True])
def test_reward_matches_hand_computation(rovist_vg_dir, glove_path, corpus, images, region_table, scaled):
    table, boxes = region_table
    # exact: the hand computation preprocesses with PIL (fast is compared in test_image_pipeline_models.py)
    reward = make(rovist_vg_dir, glove_path, idf_corpus=corpus, region_table=table, scaled=scaled,
                  image_pipeline="exact")
    assert reward.regions == "table"
    # Precomputed nouns: repeats (any case) dropped, a noun without a vector skipped.
    nouns = ["Dog", "car", "dog", "unicorn", "sky"]
    (details,) = reward.explain(["x"], images=[images[:2]], nouns=[nouns])
    assert [n["noun"] for n in details["nouns"]] == ["dog", "car", "sky"] and details["skipped"] == ["unicorn"]
    # idf = log(N / (1 + df)), N = 4 stories: dog in 2, car in 1, sky in 1.
    idf = [math.log(4 / 3), math.log(4 / 2), math.log(4 / 2)]
    assert [n["idf"] for n in details["nouns"]] == pytest.approx(idf)
    expected, best = independent_rovist_vg(
        rovist_vg_dir,
        glove_path,
        ["dog", "car", "sky"],
        [(images[0], boxes["img0"]), (images[1], boxes["img1"])],
        idf,
        scaled,
    )
    assert [n["cosine"] for n in details["nouns"]] == pytest.approx(best, abs=1e-5)
    assert details["score"] == pytest.approx(expected, abs=1e-5)
    assert reward.score(["x"], images=[images[:2]], noun_phrases=[nouns])[0] == pytest.approx(expected, abs=1e-5)
    assert reward.value_range == ((-1.0, 1.0) if scaled else (-math.inf, math.inf))


def test_batched_equals_one_by_one(rovist_vg_dir, glove_path, corpus, images):
    from storyrl.models.runtime import release_models

    reward = make(rovist_vg_dir, glove_path, idf_corpus=corpus)
    nouns = [["dog", "car"], ["sky", "dog", "tree"], ["man"], ["church", "sky"]]
    seqs = [images, images[:2], images[1:], images]
    batch = reward.score(["s"] * 4, images=seqs, nouns=nouns)
    assert np.all(np.isfinite(batch))
    release_models()  # cold caches for the one-by-one pass
    single = [
        make(rovist_vg_dir, glove_path, idf_corpus=corpus).score(["s"], images=[s], nouns=[n])[0]
        for s, n in zip(seqs, nouns)
    ]
    np.testing.assert_allclose(batch, single, atol=1e-5, rtol=0)


def test_regions_and_nouns_embedded_once(rovist_vg_dir, glove_path, images):
    from storyrl.models.runtime import release_models

    release_models()
    reward = make(rovist_vg_dir, glove_path)
    reward.score(["s"] * 6, images=[images] * 6, nouns=[["dog", "cat"]] * 6)  # GRPO candidates
    stats = reward.embedder.stats
    assert stats["regions_embedded"] == 3 * 10 and stats["texts_embedded"] == 2  # 3 images x (3x3 grid + whole)
    reward.score(["s"], images=[images], nouns=[["dog"]])
    assert stats["regions_embedded"] == 30 and stats["texts_embedded"] == 2


def test_unscorable_stories_get_nan_and_a_reason(rovist_vg_dir, glove_path, images, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    reward = make(rovist_vg_dir, glove_path, regions="whole")
    scores = reward.score(
        ["a", "b", "c", "d", "e"],
        images=[images, [str(tmp_path / "missing.png")], [str(broken)], images, images],
        nouns=[["dog"], ["dog"], ["dog"], [], ["unicorn"]],
    )
    assert np.isfinite(scores[0]) and np.isnan(scores[1:]).all()
    reasons = reward.stats["reasons"]
    assert reasons["images"] == 2 and reasons["no nouns"] == 1 and reasons["no nouns with word vectors"] == 1
    (missing,) = reward.explain(["b"], images=[[str(tmp_path / "missing.png")]], nouns=[["dog"]])
    assert "missing.png" in missing["reason"] and "not found" in missing["reason"]


def test_save_load_round_trip_gives_identical_scores(rovist_vg_dir, glove_path, images, tmp_path):
    import torch

    loaded = RovistVGModel.from_pretrained(rovist_vg_dir)
    loaded.save_pretrained(tmp_path / "again")
    again = RovistVGModel.from_pretrained(tmp_path / "again")
    pixels, vectors = torch.randn(2, 3, 32, 32), torch.randn(2, WORD_DIM)
    with torch.no_grad():
        for a, b in zip(loaded(pixels, vectors), again(pixels, vectors)):
            assert torch.equal(a, b)
    assert again.config() == loaded.config() and again.data_config["input_size"] == (3, 32, 32)
    nouns = [["dog", "car", "tree"]]
    first = make(rovist_vg_dir, glove_path).score(["s"], images=[images], nouns=nouns)
    second = make(str(tmp_path / "again"), glove_path).score(["s"], images=[images], nouns=nouns)
    np.testing.assert_array_equal(first, second)


def test_spacy_extraction_path_with_a_fake_pipeline(rovist_vg_dir, glove_path, images):
    """Without precomputed nouns the story is POS-tagged (NOUN/PROPN tokens);
    a hand-annotated Doc stands in for the English pipeline."""
    import spacy
    from spacy.tokens import Doc

    from storyrl.noun_phrases import PhraseExtractor

    vocab = spacy.blank("en").vocab

    class FakeNlp:
        def pipe(self, texts, batch_size=64):
            for _ in texts:
                yield Doc(
                    vocab,
                    words=["the", "dog", "saw", "a", "cat", "."],
                    pos=["DET", "NOUN", "VERB", "DET", "NOUN", "PUNCT"],
                )

    reward = make(rovist_vg_dir, glove_path, regions="whole")
    reward._extractor = PhraseExtractor(nlp=FakeNlp(), units="nouns")
    (parsed,) = reward.explain(["the dog saw a cat ."], images=[images])
    assert [n["noun"] for n in parsed["nouns"]] == ["dog", "cat"]
    (given,) = reward.explain(["x"], images=[images], nouns=[["dog", "cat"]])
    assert parsed["score"] == pytest.approx(given["score"])


def test_bad_configuration(rovist_vg_dir, glove_path, tmp_path):
    # Checked when scoring starts (configs load before the model exists), and raised, not NaN.
    with pytest.raises(ValueError, match="needs model"):
        RovistVG(glove=glove_path).score(["a dog."], images=[["x.png"]])
    with pytest.raises(ValueError, match="needs glove"):
        RovistVG(model=rovist_vg_dir).score(["a dog."], images=[["x.png"]])
    with pytest.raises(ValueError, match="not a storyrl RoViST-VG model"):
        RovistVG(model=str(tmp_path), glove=glove_path).score(["a dog."], images=[["x.png"]])
    with pytest.raises(ValueError, match="regions"):
        make(rovist_vg_dir, glove_path, regions="detector")
    with pytest.raises(ValueError, match="precision"):
        make(rovist_vg_dir, glove_path, precision="fp8")


def test_config_files_parse():
    import yaml

    from storyrl.config import option_info
    from storyrl.training.judges.rovist_vg import RovistVGTrainConfig

    repo = Path(__file__).resolve().parents[1]
    reward_cfg = yaml.safe_load((repo / "configs" / "rewards" / "rovist_vg.yaml").read_text())
    assert reward_cfg["reward"] == "rovist_vg" and set(reward_cfg) - {"reward"} <= {o.name for o in option_info(RovistVG.config_class)}
    train = RovistVGTrainConfig.from_yaml(repo / "configs" / "training" / "rovist_vg.yaml")
    # The paper's optimiser settings (RoViST App. B).
    assert (train.lr, train.batch_size, train.weight_decay, train.lr_decay, train.patience, train.val_fraction) == (
        5e-5,
        64,
        1e-5,
        0.95,
        3,
        0.15,
    )


# -- training ------------------------------------------------------------------------------


def test_read_pairs_errors_name_file_and_line(images, tmp_path):
    from storyrl.training.judges.rovist_vg import read_pairs

    root = Path(images[0]).parent
    good = tmp_path / "pairs.csv"
    good.write_text('image,bbox,phrase\nimg0.png,"[0, 0, 20, 20]",dog\nimg1.png,,red  car\n')
    pairs = read_pairs(good, root)
    assert pairs[0].box == (0, 0, 20, 20) and pairs[1].box is None and pairs[1].phrase == "red car"
    cases = {
        'image,bbox,phrase\nimg0.png,"[0, 0, 20]",dog\n': r"pairs\.csv, line 2: bad bbox",
        'image,bbox,phrase\nimg0.png,"[0, 0, 20, 20]",dog\nimg0.png,"[5, 5, 1, 9]",cat\n': r"line 3: bad bbox .*x2 must exceed",
        "image,bbox,phrase\nnope.png,,dog\n": r"line 2: image file not found",
        "image,bbox,phrase\nimg0.png,,\n": r"line 2: empty phrase",
        "image,box,phrase\n": r"pairs\.csv, line 1: missing column\(s\) bbox",
    }
    for text, message in cases.items():
        good.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_pairs(good, root)


def test_training_lowers_the_loss_and_saves_a_usable_model(images, glove_path, tmp_path):
    from storyrl.training.judges.rovist_vg import RegionPhraseDataset, RovistVGTrainConfig, read_pairs, train_rovist_vg

    root = Path(images[0]).parent
    pairs = tmp_path / "pairs.csv"
    rows = [
        ("img0.png", "[0, 0, 24, 20]", "dog"),
        ("img0.png", "[24, 0, 48, 40]", "red car"),
        ("img1.png", "", "sky"),
        ("img1.png", "[0, 0, 30, 30]", "tree"),
        ("img2.png", "[10, 10, 40, 40]", "man"),
        ("img2.png", "", "church"),
        ("img0.png", "", "woman"),
        ("img1.png", "[5, 5, 45, 35]", "bottle"),
        ("img2.png", "[0, 0, 20, 20]", "unicorn"),  # no GloVe vector: skipped
    ]
    pairs.write_text("image,bbox,phrase\n" + "".join(f'{i},"{b}",{p}\n' for i, b, p in rows))
    config = RovistVGTrainConfig(
        output_dir=str(tmp_path / "run"),
        pairs=str(pairs),
        image_root=str(root),
        glove=glove_path,
        epochs=12,
        batch_size=6,
        lr=3e-3,
        val_fraction=0.25,
        patience=20,
        log_every=1000,
    )
    model = rovist_vg_model(seed=3)
    dataset = RegionPhraseDataset(read_pairs(pairs, root), load_glove(glove_path), model.image_transform())
    assert len(dataset) == 8 and dataset.skipped == 1
    pixels, vector = dataset[0]
    assert tuple(pixels.shape) == (3, 32, 32) and tuple(vector.shape) == (WORD_DIM,)

    result = train_rovist_vg(config, progress=False, model=model)
    losses = [r["train_loss"] for r in result.history]
    assert len(losses) == 12 and all(np.isfinite(losses))
    # 6 training pairs (8 usable, 2 for validation) in one batch per epoch:
    # the same batch each time, so the losses are comparable.
    assert losses[-1] < 0.8 * losses[0]
    assert result.best_epoch >= 1 and (tmp_path / "run" / "train_config.yaml").is_file()
    reward = RovistVG(model=str(tmp_path / "run" / "best"), glove=glove_path, regions="whole", device="cpu")
    assert np.isfinite(reward.score(["s"], images=[images], nouns=[["dog"]])[0])
