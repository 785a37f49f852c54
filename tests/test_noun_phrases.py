"""GROOViST phrase extraction. spaCy's English pipelines cannot be installed
here, so the noun-chunk logic runs on hand-annotated Docs (spaCy's own English
noun_chunks iterator over a parse written in the test); the end-to-end check
against the authors' en_core_web_trf output runs only where that pipeline is
installed."""

from __future__ import annotations

import importlib.util
import pickle

import pytest
from conftest import load_story_json, shared_path

from storyrl.noun_phrases import (
    DEFAULT_PIPELINE,
    PLACEHOLDERS,
    PhraseExtractor,
    PipelineNotInstalled,
    load_pipeline,
    load_pronouns,
    replace_placeholders,
    scoring_phrases,
    sentence_phrases,
)
from storyrl.text import split_sentences

spacy = pytest.importorskip("spacy")
from spacy.tokens import Doc

# One sentence per entry: (word, POS, head index, dependency label), a parse of
# the kind en_core_web_trf gives.
PARSES = [
    # story 50392
    [
        ("this", "PRON", 1, "nsubj"),
        ("is", "AUX", 1, "ROOT"),
        ("the", "DET", 3, "det"),
        ("church", "NOUN", 1, "attr"),
        ("where", "SCONJ", 8, "advmod"),
        ("the", "DET", 6, "det"),
        ("wedding", "NOUN", 8, "nsubjpass"),
        ("was", "AUX", 8, "auxpass"),
        ("held", "VERB", 3, "relcl"),
        (".", "PUNCT", 1, "punct"),
    ],
    [
        ("the", "DET", 1, "det"),
        ("bridesmaids", "NOUN", 2, "nsubj"),
        ("took", "VERB", 2, "ROOT"),
        ("a", "DET", 5, "det"),
        ("quick", "ADJ", 5, "amod"),
        ("pic", "NOUN", 2, "dobj"),
        ("together", "ADV", 2, "advmod"),
        (".", "PUNCT", 2, "punct"),
    ],
    [
        ("the", "DET", 1, "det"),
        ("bride", "NOUN", 4, "nsubj"),
        ("and", "CCONJ", 1, "cc"),
        ("groom", "NOUN", 1, "conj"),
        ("leaned", "VERB", 4, "ROOT"),
        ("forward", "ADV", 4, "advmod"),
        ("for", "ADP", 4, "prep"),
        ("a", "DET", 9, "det"),
        ("quick", "ADJ", 9, "amod"),
        ("kiss", "NOUN", 6, "pobj"),
        (".", "PUNCT", 4, "punct"),
    ],
    [
        ("the", "DET", 1, "det"),
        ("guests", "NOUN", 3, "nsubjpass"),
        ("were", "AUX", 3, "auxpass"),
        ("overwhelmed", "VERB", 3, "ROOT"),
        ("with", "ADP", 3, "prep"),
        ("joy", "NOUN", 4, "pobj"),
        (".", "PUNCT", 3, "punct"),
    ],
    [
        ("the", "DET", 1, "det"),
        ("bouquet", "NOUN", 2, "nsubj"),
        ("was", "AUX", 2, "ROOT"),
        ("beautiful", "ADJ", 2, "acomp"),
        (".", "PUNCT", 2, "punct"),
    ],
    # story 48454
    [
        ("there", "PRON", 1, "expl"),
        ("was", "VERB", 1, "ROOT"),
        ("lots", "NOUN", 1, "attr"),
        ("to", "PART", 4, "aux"),
        ("see", "VERB", 2, "relcl"),
        ("and", "CCONJ", 4, "cc"),
        ("do", "VERB", 4, "conj"),
        ("at", "ADP", 6, "prep"),
        ("the", "DET", 9, "det"),
        ("festival", "NOUN", 7, "pobj"),
        (",", "PUNCT", 1, "punct"),
        ("including", "VERB", 1, "prep"),
        ("listening", "VERB", 11, "pcomp"),
        ("to", "ADP", 12, "prep"),
        ("unusual", "ADJ", 15, "amod"),
        ("instruments", "NOUN", 13, "pobj"),
        (".", "PUNCT", 1, "punct"),
    ],
    [
        ("many", "ADJ", 1, "amod"),
        ("stalls", "NOUN", 2, "nsubj"),
        ("had", "VERB", 2, "ROOT"),
        ("handmade", "ADJ", 4, "amod"),
        ("clothing", "NOUN", 2, "dobj"),
        ("and", "CCONJ", 2, "cc"),
        ("one", "NUM", 8, "nsubj"),
        ("even", "ADV", 8, "advmod"),
        ("had", "VERB", 2, "conj"),
        ("dresses", "NOUN", 8, "dobj"),
        ("specifically", "ADV", 11, "advmod"),
        ("for", "ADP", 9, "prep"),
        ("little", "ADJ", 13, "amod"),
        ("girls", "NOUN", 11, "pobj"),
        (".", "PUNCT", 2, "punct"),
    ],
    [
        ("as", "ADP", 8, "prep"),
        ("part", "NOUN", 0, "pobj"),
        ("of", "ADP", 1, "prep"),
        ("the", "DET", 5, "det"),
        ("festival", "NOUN", 5, "compound"),
        ("grounds", "NOUN", 2, "pobj"),
        (",", "PUNCT", 8, "punct"),
        ("there", "PRON", 8, "expl"),
        ("were", "VERB", 8, "ROOT"),
        ("also", "ADV", 8, "advmod"),
        ("numerous", "ADJ", 11, "amod"),
        ("sculptures", "NOUN", 8, "attr"),
        ("that", "PRON", 15, "dobj"),
        ("one", "PRON", 15, "nsubj"),
        ("could", "AUX", 15, "aux"),
        ("touch", "VERB", 11, "relcl"),
        (".", "PUNCT", 8, "punct"),
    ],
    [
        ("many", "ADJ", 1, "amod"),
        ("stalls", "NOUN", 3, "nsubjpass"),
        ("were", "AUX", 3, "auxpass"),
        ("adorned", "VERB", 3, "ROOT"),
        ("with", "ADP", 3, "prep"),
        ("handmade", "ADJ", 7, "amod"),
        ("glass", "NOUN", 7, "compound"),
        ("bottles", "NOUN", 4, "pobj"),
        (".", "PUNCT", 3, "punct"),
    ],
    [
        ("by", "ADP", 3, "prep"),
        ("midday", "NOUN", 0, "pobj"),
        ("thousands", "NOUN", 3, "nsubj"),
        ("were", "AUX", 3, "ROOT"),
        ("in", "ADP", 3, "prep"),
        ("attendance", "NOUN", 4, "pobj"),
        (",", "PUNCT", 3, "punct"),
        ("the", "DET", 9, "det"),
        ("biggest", "ADJ", 9, "amod"),
        ("turn", "NOUN", 3, "npadvmod"),
        ("out", "ADV", 9, "advmod"),
        ("yet", "ADV", 9, "advmod"),
        ("!", "PUNCT", 3, "punct"),
    ],
    # placeholders replaced (VIST anonymisation)
    [
        ("male", "NOUN", 1, "nsubj"),
        ("met", "VERB", 1, "ROOT"),
        ("female", "NOUN", 1, "dobj"),
        ("at", "ADP", 1, "prep"),
        ("the", "DET", 5, "det"),
        ("location", "NOUN", 3, "pobj"),
        (".", "PUNCT", 1, "punct"),
    ],
    # the same chunk twice in one sentence, differing in case
    [
        ("The", "DET", 1, "det"),
        ("Dog", "PROPN", 2, "nsubj"),
        ("saw", "VERB", 2, "ROOT"),
        ("the", "DET", 4, "det"),
        ("dog", "NOUN", 2, "dobj"),
        (".", "PUNCT", 2, "punct"),
    ],
]


def _doc(vocab, parse):
    words, pos, heads, deps = (list(x) for x in zip(*parse))
    return Doc(vocab, words=words, spaces=[True] * (len(words) - 1) + [False], pos=pos, heads=heads, deps=deps)


class FakeNLP:
    """spaCy-like ``pipe`` over hand-built Docs; records what it is asked."""

    def __init__(self):
        vocab = spacy.blank("en").vocab
        self.docs = {}
        for parse in PARSES:
            doc = _doc(vocab, parse)
            self.docs[doc.text] = doc
        self.calls = []

    def pipe(self, texts, batch_size=1000):
        texts = list(texts)
        self.calls.append((texts, batch_size))
        return iter([self.docs[t] for t in texts])


@pytest.fixture
def stories():
    return load_story_json("groovist", "sample_stories.json")


@pytest.fixture
def expected():
    return load_story_json("groovist", "sample_nphrases.json")


@pytest.fixture
def pronouns():
    return load_pronouns(shared_path("groovist", "all_pronouns.txt"))


def test_hand_parses_cover_the_sample_sentences(stories):
    nlp = FakeNLP()
    for story in stories.values():
        for sent in split_sentences(story):
            assert sent in nlp.docs


@pytest.mark.parametrize("sid", ["50392", "48454"])
def test_matches_authors_phrases(stories, expected, sid):
    extractor = PhraseExtractor(nlp=FakeNLP())
    assert extractor.extract([stories[sid]]) == [expected[sid]]


def test_repeats_across_sentences_kept(stories, expected):
    phrases = PhraseExtractor(nlp=FakeNLP()).extract([stories["48454"]])[0]
    assert phrases.count("many stalls") == 2
    assert phrases == expected["48454"]


def test_repeats_within_sentence_dropped_and_lower_cased():
    phrases = PhraseExtractor(nlp=FakeNLP()).extract(["The Dog saw the dog ."])
    assert phrases == [["the dog"]]


def test_placeholders_replaced_before_parsing():
    nlp = FakeNLP()
    extractor = PhraseExtractor(nlp=nlp)
    assert extractor.extract(["[male] met [female] at the [location] ."]) == [["male", "female", "the location"]]
    assert nlp.calls[0][0] == ["male met female at the location ."]
    assert replace_placeholders("[organization] and [male]") == "organization and male"
    assert set(PLACEHOLDERS) == {"[male]", "[female]", "[location]", "[organization]"}


def test_one_pipe_call_for_many_stories(stories, expected):
    nlp = FakeNLP()
    extractor = PhraseExtractor(nlp=nlp, batch_size=7)
    order = ["50392", "48454", "50392"]
    assert extractor.extract([stories[s] for s in order]) == [expected[s] for s in order]
    assert len(nlp.calls) == 1
    texts, batch_size = nlp.calls[0]
    assert batch_size == 7
    n_sentences = sum(len(split_sentences(stories[s])) for s in ("50392", "48454"))
    assert len(texts) == len(set(texts)) == n_sentences


def test_parsed_sentences_are_cached(stories, expected):
    nlp = FakeNLP()
    extractor = PhraseExtractor(nlp=nlp)
    extractor.extract([stories["50392"]])
    extractor.extract([stories["50392"], stories["48454"]])
    assert len(nlp.calls) == 2
    assert set(nlp.calls[1][0]) == set(split_sentences(stories["48454"]))
    again = extractor.extract([stories["48454"], stories["50392"]])
    assert len(nlp.calls) == 2  # nothing new to parse
    assert again == [expected["48454"], expected["50392"]]


def test_cache_is_bounded(stories, expected):
    nlp = FakeNLP()
    extractor = PhraseExtractor(nlp=nlp, cache_size=4)
    assert extractor.extract([stories["50392"], stories["48454"]]) == [expected["50392"], expected["48454"]]
    assert len(extractor._cache) <= 4
    assert extractor.extract([stories["48454"]]) == [expected["48454"]]


def test_units_nouns(stories):
    extractor = PhraseExtractor(units="nouns", nlp=FakeNLP())
    assert extractor.extract([stories["50392"], "The Dog saw the dog ."]) == [
        ["church", "wedding", "bridesmaids", "pic", "bride", "groom", "kiss", "guests", "joy", "bouquet"],
        ["dog"],
    ]


def test_units_validated():
    with pytest.raises(ValueError, match="units"):
        PhraseExtractor(units="verbs", nlp=FakeNLP())
    doc = next(iter(FakeNLP().docs.values()))
    with pytest.raises(ValueError, match="units"):
        sentence_phrases(doc, units="verbs")


def test_empty_story():
    nlp = FakeNLP()
    assert PhraseExtractor(nlp=nlp).extract(["", "   "]) == [[], []]
    assert nlp.calls == []


def test_scoring_phrases_with_authors_pronouns(stories, expected, pronouns):
    assert {"this", "that", "one", "i", "I"} <= pronouns
    assert scoring_phrases(expected["50392"], pronouns) == expected["50392"][1:]
    raw = PhraseExtractor(nlp=FakeNLP()).extract([stories["48454"]])[0]
    scored = scoring_phrases(raw, pronouns)
    assert "that" not in scored and "one" not in scored
    assert scored.count("many stalls") == 1
    assert scored == [p for i, p in enumerate(raw) if p not in ("that", "one") and p not in raw[:i]]


def test_scoring_phrases_accepts_any_iterable():
    assert scoring_phrases(["it", "a dog", "a dog", "the cat"], ["it"]) == ["a dog", "the cat"]


def test_load_pronouns_strips_and_skips_blank_lines(tmp_path):
    path = tmp_path / "pronouns.txt"
    path.write_text("he\n  she \n\nno one\r\n", encoding="utf-8")
    assert load_pronouns(path) == frozenset({"he", "she", "no one"})


def test_picklable_without_pipeline_and_cache(stories):
    extractor = PhraseExtractor("no_such_pipeline_xyz", nlp=FakeNLP(), batch_size=3)
    extractor.extract([stories["50392"]])
    copy = pickle.loads(pickle.dumps(extractor))
    assert (copy.pipeline, copy.units, copy.batch_size) == ("no_such_pipeline_xyz", "noun_phrases", 3)
    assert copy._nlp is None and copy._cache == {}
    with pytest.raises(PipelineNotInstalled):
        copy.extract([stories["50392"]])


def test_missing_pipeline_names_install_command():
    if importlib.util.find_spec("en_core_web_sm") is not None:
        pytest.skip("en_core_web_sm is installed here")
    with pytest.raises(PipelineNotInstalled, match="python -m spacy download en_core_web_sm"):
        load_pipeline("en_core_web_sm")
    assert issubclass(PipelineNotInstalled, RuntimeError)


def test_real_pipeline_matches_authors(stories, expected):
    """End to end with the authors' parser, where it is installed."""
    pytest.importorskip(DEFAULT_PIPELINE, reason=f"spaCy pipeline {DEFAULT_PIPELINE} not installed")
    extractor = PhraseExtractor(DEFAULT_PIPELINE)
    ids = list(stories)
    assert extractor.extract([stories[s] for s in ids]) == [expected[s] for s in ids]
