"""Phrase weights: GROOViST concreteness (on the authors' ratings file), the
offline noun lemmatizer, idf and the unweighted ablation."""

from __future__ import annotations

import json
import math
import pickle

import pytest
from conftest import shared_path

from storyrl.word_weights import (
    Concreteness,
    Idf,
    NoWeights,
    lemmatize_noun,
    load_concreteness,
)


@pytest.fixture(scope="module")
def ratings_path():
    return shared_path("groovist", "concreteness_ratings.csv")


@pytest.fixture(scope="module")
def reference(ratings_path):
    """The ratings read the way GROOViST's utils.py reads them."""
    lines = ratings_path.read_text(encoding="utf-8").splitlines()[1:]
    return {line.strip().split(";")[0]: float(line.strip().split(";")[1]) for line in lines}


@pytest.fixture(scope="module")
def conc(ratings_path):
    return Concreteness.from_path(ratings_path)


# ---------------------------------------------------------------- ratings file


def test_loads_authors_file(ratings_path, reference):
    ratings = load_concreteness(ratings_path)
    assert ratings == reference
    assert len(ratings) > 39_000


def test_bom_and_header_not_keys(ratings_path):
    ratings = load_concreteness(ratings_path)
    first = next(iter(ratings))
    assert not first.startswith("\ufeff")
    assert "Word" not in ratings and "\ufeffWord" not in ratings


def test_keys_keep_case(ratings_path):
    ratings = load_concreteness(ratings_path)
    assert "I" in ratings  # capitalised entries are kept as written


def test_result_is_a_fresh_dict(ratings_path):
    first = load_concreteness(ratings_path)
    first["church"] = -1.0
    assert load_concreteness(ratings_path)["church"] != -1.0


def test_reloads_a_changed_file(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("Word;Conc.M\ndog;4.5\n", encoding="utf-8")
    assert load_concreteness(path) == {"dog": 4.5}
    path.write_text("Word;Conc.M\ndog;4.5\ncat;4.25\n", encoding="utf-8")
    assert load_concreteness(path) == {"dog": 4.5, "cat": 4.25}


def test_brysbaert_tab_separated(tmp_path):
    path = tmp_path / "Concreteness_ratings_Brysbaert_et_al_BRM.txt"
    path.write_text(
        "Word\tBigram\tConc.M\tConc.SD\tUnknown\tTotal\tPercent_known\tSUBTLEX\tDom_Pos\n"
        "roadsweeper\t0\t4.85\t0.37\t1\t27\t0.96\t0\t0\n"
        "ID card\t1\t4.8\t0.4\t0\t30\t1\t0\t0\n"
        "essentialness\t0\t1.04\t0.2\t2\t28\t0.93\t0\tNoun\n",
        encoding="utf-8",
    )
    assert load_concreteness(path) == {"roadsweeper": 4.85, "ID card": 4.8, "essentialness": 1.04}


def test_crlf_and_bom(tmp_path):
    path = tmp_path / "r.csv"
    path.write_bytes("\ufeffWord;Conc.M\r\ndog;4.5\r\n\r\n".encode("utf-8"))
    assert load_concreteness(path) == {"dog": 4.5}


@pytest.mark.parametrize(
    "body, line, problem",
    [
        ("dog;4.5\ncat;high\n", 3, "not a number"),
        ("dog;4.5\ncat\n", 3, "fields"),
        ("dog;4.5\n;3.0\n", 3, "empty word"),
        ("dog;nan\n", 2, "not finite"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, body, line, problem):
    path = tmp_path / "broken.csv"
    path.write_text("Word;Conc.M\n" + body, encoding="utf-8")
    with pytest.raises(ValueError, match=problem) as info:
        load_concreteness(path)
    assert str(path.resolve()) in str(info.value)
    assert f"line {line}" in str(info.value)


def test_unrecognised_header(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("word,rating\ndog,4.5\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1"):
        load_concreteness(path)
    path.write_text("Lemma;Mean\ndog;4.5\n", encoding="utf-8")
    with pytest.raises(ValueError, match="Conc.M"):
        load_concreteness(path)


def test_default_path_is_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STORYRL_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="storyrl assets"):
        load_concreteness()
    (tmp_path / "concreteness_ratings.csv").write_text("Word;Conc.M\ndog;4.5\n", encoding="utf-8")
    assert load_concreteness() == {"dog": 4.5}
    assert Concreteness.from_path().weight("a dog") == 4.5


# ------------------------------------------------------------- lemmatization


@pytest.mark.parametrize(
    "word, vocabulary, lemma",
    [
        ("children", {"child"}, "child"),
        ("geese", {"goose"}, "goose"),
        ("mice", {"mouse"}, "mouse"),
        ("wolves", {"wolf"}, "wolf"),
        ("criteria", {"criterion"}, "criterion"),
        ("churches", {"church"}, "church"),
        ("boxes", {"box"}, "box"),
        ("buzzes", {"buzz"}, "buzz"),
        ("dishes", {"dish"}, "dish"),
        ("parties", {"party"}, "party"),
        ("bottles", {"bottle"}, "bottle"),
        ("women", {"woman"}, "woman"),
        ("firemen", {"fireman"}, "fireman"),
        ("glasses", {"glass"}, "glass"),
        ("glasses", {"glass", "glasses"}, "glass"),  # shortest, as NLTK's min(key=len)
        ("bus", {"bus"}, "bus"),
        ("stalls", {"stall"}, "stall"),
        ("boxess", {"box"}, "box"),  # nothing after one round: morphy applies the rules again
        ("xyzzies", {"church"}, None),
        ("children", {"childre"}, None),  # irregular plurals use the exception table only
        ("", {"church"}, None),
    ],
)
def test_lemmatize_noun(word, vocabulary, lemma):
    assert lemmatize_noun(word, vocabulary) == lemma


def test_lemmatize_with_authors_vocabulary(reference):
    assert "geese" not in reference and lemmatize_noun("geese", reference) == "goose"
    assert "churches" not in reference and lemmatize_noun("churches", reference) == "church"


# ----------------------------------------------------------------- Concreteness


def test_weight_is_mean_of_rated_words(conc, reference):
    assert conc.weight("the church") == (reference["the"] + reference["church"]) / 2
    assert conc.weight("the bouquet") == (reference["the"] + reference["bouquet"]) / 2
    assert conc.weight("  the church ") == conc.weight("the church")


def test_plural_rated_through_its_lemma(conc, reference):
    assert "stalls" not in reference and "stall" in reference
    assert conc.weight("many stalls") == (reference["many"] + reference["stall"]) / 2
    assert "bottles" not in reference
    expected = (reference["handmade"] + reference["glass"] + reference["bottle"]) / 3
    assert conc.weight("handmade glass bottles") == expected


def test_unrated_words_are_skipped(conc, reference):
    assert "pic" not in reference and "pics" not in reference
    assert conc.weight("a quick pic") == (reference["a"] + reference["quick"]) / 2


def test_no_rated_word_weighs_one(conc):
    assert conc.weight("zqxjk") == 1.0
    assert conc.weight("zqxjk vwpfh") == 1.0
    assert conc.weight("") == 1.0


def test_matching_is_case_sensitive(conc, reference):
    # GROOViST looks words up exactly; phrases reach it lower-cased.
    assert "Church" not in reference
    assert conc.weight("Church") == 1.0


def test_weights_list_and_cache(reference):
    conc = Concreteness(reference)
    phrases = ["the church", "joy", "the church"]
    assert conc.weights(phrases) == [conc.weight(p) for p in phrases]
    assert conc.weight("joy") == reference["joy"]
    assert set(conc._cache) == {"the church", "joy"}


def test_concreteness_small_dict_and_pickle():
    conc = Concreteness({"dog": 4.0, "the": 1.0, "child": 5.0})
    assert conc.weight("the dogs") == 2.5
    assert conc.weight("the children") == 3.0
    assert pickle.loads(pickle.dumps(conc)).weight("the dogs") == 2.5


# ------------------------------------------------------------------------- Idf


CORPUS = ["The dog ran.", "the cat ran .", "a bird sang ."]


def test_idf_by_hand():
    idf = Idf.from_stories(CORPUS)
    assert idf.n_docs == 3
    assert idf.df["the"] == 2 and idf.df["ran"] == 2 and idf.df["."] == 3 and idf.df["dog"] == 1
    assert idf.idf("the") == math.log(3 / 3)
    assert idf.idf("dog") == math.log(3 / 2)
    assert idf.idf(".") == math.log(3 / 4)  # in every story: slightly negative
    assert idf.idf("zebra") == math.log(3)  # unseen: df = 0


def test_idf_phrase_mean():
    idf = Idf.from_stories(CORPUS)
    assert idf.weight("the dog") == (math.log(1) + math.log(1.5)) / 2
    assert idf.weight("The  Dog") == idf.weight("the dog")
    assert idf.weights(["the dog", "zebra"]) == [idf.weight("the dog"), math.log(3)]
    assert idf.weight("") == 0.0


def test_idf_counts_a_word_once_per_story():
    idf = Idf.from_stories(["dog dog dog .", "cat ."])
    assert idf.df["dog"] == 1


def test_idf_json_round_trip(tmp_path):
    idf = Idf.from_stories(CORPUS)
    path = tmp_path / "idf.json"
    idf.to_json(path)
    loaded = Idf.from_json(path)
    assert loaded.n_docs == idf.n_docs and loaded.df == idf.df
    assert loaded.weight("the dog") == idf.weight("the dog")
    assert json.loads(path.read_text(encoding="utf-8"))["n_docs"] == 3


def test_idf_from_counts_and_validation(tmp_path):
    idf = Idf.from_counts(10, {"dog": 4})
    assert idf.idf("dog") == math.log(10 / 5)
    with pytest.raises(ValueError):
        Idf.from_counts(0, {})
    with pytest.raises(ValueError):
        Idf.from_stories([])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"n_docs": 3}), encoding="utf-8")
    with pytest.raises(ValueError, match="n_docs"):
        Idf.from_json(bad)


# -------------------------------------------------------------------- NoWeights


def test_no_weights():
    weights = NoWeights()
    assert weights.weight("the church") == 1.0
    assert weights.weights(["a", "b", "c"]) == [1.0, 1.0, 1.0]
    assert weights.weights(iter([])) == []
