"""Sentence and word splitting that reproduces the metric authors' NLTK setup.

The published scores (RoViST-NR, RoViST-C, GROOViST) were computed with NLTK 3.8's
``sent_tokenize`` (the pre-trained English Punkt model) and ``word_tokenize``.
Neither the model data nor NLTK is needed here: this module implements

* the Punkt *algorithm* with no trained statistics plus the two things of the
  English model that matter on story text (``ABBREVIATIONS`` and "an ellipsis
  followed by a capitalised word ends a sentence"), which matches the authors'
  splits on every VIST and VWP story we have (shared/docs/reference-notes.md);
* NLTK 3.8's Treebank-style word tokenizer (``NLTKWordTokenizer``), whose regex
  cascade is applied rule by rule, skipping rules whose trigger characters are
  absent, so that plain sentences cost a couple of regex passes.

Everything is pure Python and the hot paths are cached, because repetition
scoring inside an RL loop is dominated by splitting.
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = [
    "ABBREVIATIONS",
    "sentence_spans",
    "split_sentences",
    "treebank_tokenize",
    "word_tokenize",
    "tokenize_story",
    "clear_caches",
]

#: Abbreviations the English Punkt model knows and that occur in story text.
#: Only a period glued to the word counts ("mr." but not "mr .").
ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "st", "jr", "vs", "u.s", "a.m", "t.j", "ok", "ill", "wash"}
)

# ---------------------------------------------------------------------------
# Punkt sentence splitting
# ---------------------------------------------------------------------------

_SENT_END = ".?!"
# Characters that cannot appear inside a Punkt word token.
_NON_WORD = r"""(?:[)";}\]*:@'({\[?!])"""
_MULTI_CHAR = r"(?:\-{2,}|\.{2,}|(?:\.\s){2,}\.)"
_PUNKT_WORD = re.compile(
    rf"""(
        {_MULTI_CHAR}
        |
        (?=[^(\"`{{\[:;&\#*@)}}\]\-,])\S+?
        (?=\s|$|{_NON_WORD}|{_MULTI_CHAR}|,(?=$|\s|{_NON_WORD}|{_MULTI_CHAR}))
        |
        \S
    )""",
    re.UNICODE | re.VERBOSE,
)
# A potential sentence end and what follows it (punctuation, or the next token).
_PERIOD_CONTEXT = re.compile(
    rf"[.?!](?=(?P<after_tok>{_NON_WORD}|\s+(?P<next_tok>\S+)))", re.UNICODE
)
# Closing punctuation that belongs to the previous sentence.
_REALIGN = re.compile(r"""["')\]}]+?(?:\s+|(?=--)|$)""", re.MULTILINE)
_NUMERIC = re.compile(r"^-?[.,]?\d[\d,.-]*\.?$")
_INITIAL = re.compile(r"[^\W\d]\.$", re.UNICODE)
_ASCII_WHITESPACE = frozenset(" \t\n\r\x0b\x0c")  # Punkt uses string.whitespace here
_NOT_SENT_STARTERS = frozenset(";:,.!?")


def _is_ellipsis(tok: str) -> bool:
    return len(tok) > 1 and tok.strip(".") == ""


def _starts_sentence(tok: str):
    """Punkt's orthographic heuristic with no trained orthographic context."""
    if tok in _NOT_SENT_STARTERS:
        return False
    if tok[0].islower():
        return False
    return None  # unknown


@lru_cache(maxsize=1 << 16)
def _context_has_break(context: str) -> bool:
    """Punkt's ``text_contains_sentbreak`` on the few tokens around a candidate."""
    if "\n" in context:
        tokens = [t for line in context.split("\n") if line.strip() for t in _PUNKT_WORD.findall(line)]
    else:
        tokens = _PUNKT_WORD.findall(context)
    n = len(tokens)
    for i, tok in enumerate(tokens):
        # first pass: type-based annotation
        sentbreak = ellipsis = False
        if tok in _SENT_END:
            sentbreak = True
        elif _is_ellipsis(tok):
            ellipsis = True
        elif tok.endswith(".") and not tok.endswith(".."):
            # a known abbreviation's period does not end the sentence
            low = tok[:-1].lower()
            sentbreak = low not in ABBREVIATIONS and low.split("-")[-1] not in ABBREVIATIONS
        # second pass: token-context annotation (needs a following token)
        if i + 1 < n and tok.endswith("."):
            nxt = tokens[i + 1]
            initial = _INITIAL.match(tok) is not None
            if ellipsis and nxt[0].isupper():
                # What the English model's orthographic data does on story text.
                sentbreak = True
            elif initial or _NUMERIC.match(tok) or tok.lower() == "##number##.":
                starter = _starts_sentence(nxt)
                if starter is False or (initial and nxt[0].isupper()):
                    sentbreak = False
        if sentbreak:
            return i + 1 < n
    return False


def _candidate_contexts(text: str):
    """Punkt's ``_match_potential_end_contexts``: candidates with the previous
    word, dropping a candidate whose word overlaps the next one ("!!!")."""
    prev_start = prev_stop = 0
    prev_match = None
    for match in _PERIOD_CONTEXT.finditer(text):
        start = match.start()
        # index of the last ASCII whitespace between the previous word and here;
        # Punkt treats "found at index 0" like "not found".
        ws = 0
        for k in range(start - 1, prev_stop - 1, -1):
            if text[k] in _ASCII_WHITESPACE:
                ws = k - prev_stop
                break
        word_start = ws + prev_stop + 1 if ws else prev_start
        if prev_match is not None and prev_stop <= word_start:
            yield prev_match, text[prev_start:prev_stop] + prev_match.group() + prev_match.group("after_tok")
        prev_match, prev_start, prev_stop = match, word_start, start
    if prev_match is not None:
        yield prev_match, text[prev_start:prev_stop] + prev_match.group() + prev_match.group("after_tok")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the sentences of ``text``, as NLTK 3.8's
    English ``sent_tokenize`` gives them."""
    stripped = text.rstrip()
    end = len(stripped)
    # No candidate boundary unless a sentence-end character has something after
    # it: text ending in "...", "?" or "!" with none earlier is one sentence.
    core = stripped.rstrip(".")
    if core[-1:] in ("?", "!"):
        core = core[:-1]
    if "." not in core and "?" not in core and "!" not in core:
        return [(0, end)] if end else []
    raw = []
    last = 0
    for match, context in _candidate_contexts(text):
        if _context_has_break(context):
            raw.append((last, match.end()))
            last = match.start("next_tok") if match.group("next_tok") else match.end()
    raw.append((last, end))
    # Realign closing quotes/brackets that follow the break onto the sentence.
    spans = []
    shift = 0
    for k, (s1, e1) in enumerate(raw):
        s1 += shift
        if k + 1 == len(raw):
            if e1 > s1:
                spans.append((s1, e1))
            break
        s2, e2 = raw[k + 1]
        m = _REALIGN.match(text, s2, max(e2, s2))
        if m:
            spans.append((s1, s2 + len(m.group(0).rstrip())))
            shift = m.end() - s2
        else:
            shift = 0
            if e1 > s1:
                spans.append((s1, e1))
    return spans


def split_sentences(text: str) -> list[str]:
    """NLTK 3.8 ``sent_tokenize(text)`` (English) without the model data."""
    return [text[s:e] for s, e in sentence_spans(text)]


# ---------------------------------------------------------------------------
# Treebank word tokenization (NLTK 3.8 NLTKWordTokenizer)
# ---------------------------------------------------------------------------

# NLTK's rules, in NLTK's order. Each step runs only when a character it could
# act on is present; rules that just pad single characters use str.replace,
# which is equivalent and avoids regex template expansion.
_STARTING_QUOTES_1 = re.compile(r"([«“‘„]|[`]+)")
_STARTING_DQUOTE = re.compile(r'^"')
_OPENING_QUOTE = re.compile(r"""([ (\[{<])("|'{2})""")
_QUOTE_CLITIC = re.compile(r"(?i)(')(?!re|ve|ll|m|t|s|d|n)(\w)\b")
_FINAL_PERIOD_1 = re.compile(r"""([^.])(\.)([\])}>"'»”’ ]*)\s*$""")
_FINAL_PERIOD_2 = re.compile(r"""([^.])(\.)([\])}>"']*)\s*$""")
_COLON_COMMA = re.compile(r"([:,])([^\d])")
_COMMA_AHEAD = re.compile(r",(?=[^\d])")
_COLON_AHEAD = re.compile(r":(?=[^\d])")
_COLON_COMMA_END = re.compile(r"([:,])$")
_ELLIPSIS = re.compile(r"\.{2,}")
_QUOTE_SPACE = re.compile(r"([^'])' ")
_CLITIC_1 = re.compile(r"([^' ])('[sS]|'[mM]|'[dD]|') ")
_CLITIC_2 = re.compile(r"([^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) ")
# MacIntyre contractions NLTK splits ("cannot" -> "can not"); one cheap search
# decides whether any of them can apply.
_CONTRACTIONS = [
    re.compile(p)
    for p in (
        r"(?i)\b(can)(not)\b",
        r"(?i)\b(d)('ye)\b",
        r"(?i)\b(gim)(me)\b",
        r"(?i)\b(gon)(na)\b",
        r"(?i)\b(got)(ta)\b",
        r"(?i)\b(lem)(me)\b",
        r"(?i)\b(more)('n)\b",
        r"(?i)\b(wan)(na)(?=\s)",
        r"(?i) ('t)(is)\b",
        r"(?i) ('t)(was)\b",
    )
]
# Searched in lower-cased text: much faster than a case-insensitive search.
_CONTRACTION_HINT = re.compile(r"cannot|d'ye|gimme|gonna|gotta|lemme|more'n|wanna|'t(?:is|was)")
# Letters, digits and spaces, optionally ending " .": no rule changes the split.
_PLAIN = re.compile(r"[A-Za-z0-9 ]*(?: \.)? *\Z")


def _pad(text: str, chars: str) -> str:
    for c in chars:
        if c in text:
            text = text.replace(c, f" {c} ")
    return text


@lru_cache(maxsize=1 << 16)
def _treebank_cached(text: str) -> tuple[str, ...]:
    has_dquote = '"' in text
    # starting quotes
    if "`" in text or "«" in text or "“" in text or "‘" in text or "„" in text:
        text = _STARTING_QUOTES_1.sub(r" \1 ", text)
    if has_dquote:
        text = _STARTING_DQUOTE.sub("``", text)
    if "`" in text:
        text = text.replace("``", " `` ")
    if has_dquote or "''" in text:
        text = _OPENING_QUOTE.sub(r"\1 `` ", text)
    if "'" in text:
        text = _QUOTE_CLITIC.sub(r"\1 \2", text)
    # punctuation; the common "word." ending is done by hand: for it the two
    # final-period rules give exactly text[:-1] + "  . " (nothing else in the
    # rules between them can touch that tail).
    plain_end = len(text) > 1 and text[-1] == "." and text[-2] != "."
    if plain_end:
        text = text[:-1] + " .  "
    elif "." in text:
        text = _FINAL_PERIOD_1.sub(r"\1 \2 \3 ", text)
    if "," in text or ":" in text:
        if ",," in text or ",:" in text or ":," in text or "::" in text:
            text = _COLON_COMMA.sub(r" \1 \2", text)
        else:  # no adjacent marks: padding each one is the same thing
            text = _COLON_AHEAD.sub(" : ", _COMMA_AHEAD.sub(" , ", text))
        text = _COLON_COMMA_END.sub(r" \1 ", text)
    if ".." in text:
        text = _ELLIPSIS.sub(r" \g<0> ", text)
    text = _pad(text, ";@#$%&")
    if plain_end:
        text = text[:-4] + "  . "
    elif "." in text:
        text = _FINAL_PERIOD_2.sub(r"\1 \2\3 ", text)
    text = _pad(text, "?!")
    if "' " in text:
        text = _QUOTE_SPACE.sub(r"\1 ' ", text)
    text = _pad(text, "*[](){}<>")
    if "--" in text:
        text = text.replace("--", " -- ")
    # ending quotes, on the text padded with spaces
    text = " " + _pad(text, "»”’") + " "
    if "''" in text:
        text = text.replace("''", " '' ")
    if has_dquote:
        text = text.replace('"', " '' ")
    if "'" in text:
        text = _CLITIC_2.sub(r"\1 \2 ", _CLITIC_1.sub(r"\1 \2 ", text))
    if _CONTRACTION_HINT.search(text.lower()):
        for regex in _CONTRACTIONS:
            text = regex.sub(r" \1 \2 ", text)
    return tuple(text.split())


def treebank_tokenize(sentence: str) -> list[str]:
    """NLTK 3.8 ``NLTKWordTokenizer().tokenize(sentence)``."""
    if _PLAIN.match(sentence) and not _CONTRACTION_HINT.search(sentence.lower()):
        return sentence.split()
    return list(_treebank_cached(sentence))


def word_tokenize(text: str) -> list[str]:
    """NLTK 3.8 ``word_tokenize(text)``: split into sentences, then Treebank."""
    return [tok for sent in split_sentences(text) for tok in treebank_tokenize(sent)]


def tokenize_story(text: str) -> list[list[str]]:
    """Words of each sentence, as the authors computed ``[word_tokenize(s) for s
    in sent_tokenize(story)]`` (each sentence is re-split, as NLTK does)."""
    return [word_tokenize(sent) for sent in split_sentences(text)]


def clear_caches() -> None:
    """Forget cached splits (benchmarks call this so every run does the work)."""
    _context_has_break.cache_clear()
    _treebank_cached.cache_clear()
