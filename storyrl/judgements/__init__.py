"""Human judgements of stories and captions, as their authors released them:
VHED's ranked story pairs (:mod:`~storyrl.judgements.vhed`), VIST-Edit's
edited stories and human ratings (:mod:`~storyrl.judgements.vist_edit`,
:mod:`~storyrl.judgements.ratings`), generic preference pairs
(:mod:`~storyrl.judgements.pairs`) and COSMiC's RaCCoon caption ratings
(:mod:`~storyrl.judgements.raccoon`).

The learned metrics train on them (:mod:`storyrl.training`) and
``storyrl meta-eval`` measures every reward against them
(:mod:`storyrl.eval`). Loaders validate every record; a fault is a
:class:`JudgementDataError` naming the file, the record and what is wrong.
"""

from __future__ import annotations

__all__ = ["JudgementDataError"]


class JudgementDataError(ValueError):
    """A malformed human-judgement file: one line naming the file, the record
    (row or entry) and the fault."""
