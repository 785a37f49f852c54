"""Pieces every step of the rl_vist example shares: where the data is, what a
text policy is shown of an image sequence (the prompt), and the chat format
of the tiny policy.

A text policy never sees the images. As a stand-in for them, the prompt
carries the sequence's *concrete words*: the words of the human story whose
noun lemma (``storyrl.word_weights.lemmatize_noun``) has a Brysbaert
concreteness rating of at least ``MIN_CONCRETENESS`` (the ratings GROOViST
uses; ``../shared/data/groovist/concreteness_ratings.csv``), in story order,
one per lemma, at most ``MAX_NOUNS``, minus a few frequent non-nouns. No
spaCy English pipeline is installed offline, so this deterministic filter
replaces a noun tagger; it keeps mostly nouns of visible things (``church,
booth, kids, prize``).

The prompt is storyrl's default RL prompt for the sequence (the d_HM paper's
visual prompt P3 with the number of images, as ``storyrl train rl`` renders
it) followed by ``" Things in the images: w1, w2, ...."``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: VIST test human stories {story_id: story} (the d_HM authors' release); never copied here.
DEFAULT_STORIES = Path(os.environ.get("STORYRL_VIST_STORIES", ROOT.parent / "shared" / "data" / "dhm" / "vist" /
                                      "gt_test.json"))
DEFAULT_CONCRETENESS = Path(os.environ.get("STORYRL_CONCRETENESS", ROOT.parent / "shared" / "data" / "groovist" /
                                           "concreteness_ratings.csv"))
PROMPTS_FILE = ROOT / "configs" / "prompts" / "dhm.yaml"
PROMPT_NAME = "P3"
N_IMAGES = 5  # every VIST sequence has five images
MIN_CONCRETENESS = 4.3
MAX_NOUNS = 8
#: Frequent VIST words that are concrete as nouns but mostly used otherwise.
NOT_NOUNS = frozenset({"saw", "back", "left", "watch", "match", "fly", "ring", "wave", "sink", "can", "will",
                       "rock", "kind", "light", "last", "park", "top", "dance", "face", "line", "shot", "hand"})
NOUNS_LEAD = "Things in the images:"

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
EOS = "[EOS]"


def base_prompt(n_images: int = N_IMAGES) -> str:
    """storyrl's prompt text for a sequence of ``n_images`` (P3, count as a word)."""
    from storyrl.generators.prompts import load_prompts

    return load_prompts(PROMPTS_FILE)[("visual", PROMPT_NAME)].render(n_images)


def add_nouns(prompt: str, nouns: Sequence[str]) -> str:
    """``prompt`` with the sequence's nouns appended (the policy's view of the images)."""
    return f"{prompt} {NOUNS_LEAD} {', '.join(nouns) if nouns else 'nothing'}."


def user_prompt(nouns: Sequence[str], n_images: int = N_IMAGES) -> str:
    """The user message a policy gets for a sequence with these nouns."""
    return add_nouns(base_prompt(n_images), nouns)


def chat_text(prompt: str, story: str | None = None) -> str:
    """The chat-formatted prompt (``CHAT_TEMPLATE``, generation prompt added),
    followed by `` story [EOS]`` when a story is given (pretraining text)."""
    text = f"user : {prompt}\nassistant :"
    return text if story is None else f"{text} {story} {EOS}"


def load_ratings(path: str | os.PathLike = DEFAULT_CONCRETENESS) -> dict[str, float]:
    from storyrl.word_weights import load_concreteness

    return load_concreteness(path)


def story_nouns(story: str, ratings: Mapping[str, float], min_rating: float = MIN_CONCRETENESS,
                limit: int = MAX_NOUNS) -> list[str]:
    """The concrete words of ``story`` (module docs), as written, in order."""
    from storyrl.text import tokenize_story
    from storyrl.word_weights import lemmatize_noun

    out, lemmas = [], set()
    for sentence in tokenize_story(story):
        for word in sentence:
            word = word.lower()
            if not re.fullmatch(r"[a-z]+", word) or word in NOT_NOUNS:
                continue
            lemma = lemmatize_noun(word, ratings)
            if lemma is None or lemma in lemmas or lemma in NOT_NOUNS or ratings[lemma] < min_rating:
                continue
            lemmas.add(lemma)
            out.append(word)
            if len(out) == limit:
                return out
    return out


#: What the policy tokenizer's decoder (WordPiece, ``cleanup=True``) glues to the word before it.
_GLUED = re.compile(r"(?<=\S)([.,?!]|n't|'m|'s|'ve|'re)(?=\s|$|[.,?!])")


def vist_spacing(story: str) -> str:
    """``story`` as decoded by the policy's tokenizer, spaced back as VIST
    text is (``"seats. it's"`` -> ``"seats . it 's"``). The decoder joins
    ``" ."``, ``" n't"``, ... to the word before; the word-level tokenizer
    splits on whitespace only, so without this the text of a sampled story
    (``storyrl pairs`` writes text) would come back as ``[UNK]`` for every
    word that ends a sentence or clause."""
    previous = None
    while previous != story:  # "end.." needs two passes
        previous, story = story, _GLUED.sub(r" \1", story)
    return story
