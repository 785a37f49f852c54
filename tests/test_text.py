"""The splitter reproduces NLTK 3.8 sent_tokenize/word_tokenize (English Punkt
model behaviour) without model data; nltk_reference.py is the independent
reference built from NLTK's own algorithm."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nltk_reference as ref
from conftest import load_story_json
from storyrl import text


@pytest.mark.parametrize(
    "story, sentences",
    [
        ("the dog ran . it was fast .", ["the dog ran .", "it was fast ."]),
        ("Mr. Smith went to Washington. He liked it.", ["Mr. Smith went to Washington.", "He liked it."]),
        ("We met at 10 a.m. and left.", ["We met at 10 a.m. and left."]),
        ("He waited... Then he left.", ["He waited...", "Then he left."]),
        ("he waited... then he left.", ["he waited... then he left."]),
        ('She said "Go!" Then she ran.', ['She said "Go!"', "Then she ran."]),
        ("Wow!? Yes.", ["Wow!?", "Yes."]),
        ("I met J. Smith there.", ["I met J. Smith there."]),
        ("It was 1999. We were young.", ["It was 1999.", "We were young."]),
        ("", []),
        ("   ", []),
        ("no punctuation at all", ["no punctuation at all"]),
    ],
)
def test_sentence_examples(story, sentences):
    assert text.split_sentences(story) == sentences
    assert ref.sent_tokenize(story) == sentences


@pytest.mark.parametrize(
    "sentence, tokens",
    [
        ("i cannot go .", ["i", "can", "not", "go", "."]),
        ("[female] 's booth was great .", ["[", "female", "]", "'s", "booth", "was", "great", "."]),
        ("She didn't say \"hi\", did she?", ["She", "did", "n't", "say", "``", "hi", "''", ",", "did", "she", "?"]),
        ("'the end", ["'the", "end"]),  # NLTK 3.8 keeps it (3.9 splits it)
        ("It costs $5, ok...", ["It", "costs", "$", "5", ",", "ok", "..."]),
    ],
)
def test_word_examples(sentence, tokens):
    assert text.word_tokenize(sentence) == tokens
    assert ref.word_tokenize(sentence) == tokens


@pytest.mark.parametrize("dataset", ["vist", "vwp"])
@pytest.mark.parametrize("name", ["gt_test", "llava_vc_p3"])
def test_matches_nltk_on_every_story(dataset, name):
    stories = load_story_json("dhm", dataset, f"{name}.json")
    for story_id, story in stories.items():
        expected = [ref.word_tokenize(s) for s in ref.sent_tokenize(story)]
        assert text.tokenize_story(story) == expected, story_id


_PIECES = st.sampled_from(
    "a A the The he She Mr. mr. Dr. St. U.S. a.m. ok. J. 1999. 3.5 10 . .. ... ? ! , ; : ' \" ` ( ) [ ] { } < > - -- "
    "« » “ ” ‘ ’ cannot gonna 'tis n't 's 've $ % & * @ # é ß \n \t".split(" ")
)
_TEXT = st.lists(st.tuples(_PIECES, st.sampled_from(["", " ", "  ", "\n"])), max_size=30).map(
    lambda parts: "".join(p + sep for p, sep in parts)
)


@settings(max_examples=1500, deadline=None)
@given(_TEXT)
def test_matches_nltk_on_tricky_text(story):
    assert text.split_sentences(story) == ref.sent_tokenize(story)
    for sent in ref.sent_tokenize(story):
        assert text.word_tokenize(sent) == ref.word_tokenize(sent)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_matches_nltk_on_any_unicode(story):
    assert text.split_sentences(story) == ref.sent_tokenize(story)
    assert text.tokenize_story(story) == [ref.word_tokenize(s) for s in ref.sent_tokenize(story)]
