"""TAPM's adaptation loss: margin ranking between the decoder's state at each
sentence's start token and the visual encoding of its image, against the other
images of the same story, in both directions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["adaptation_loss", "ranking_hinge"]


def ranking_hinge(a: torch.Tensor, b: torch.Tensor, mask_a: torch.Tensor, mask_b: torch.Tensor,
                  margin: float = 1.0) -> tuple[torch.Tensor, int, int]:
    """Hinge ``max(0, margin + s(a_i, b_j) - s(a_i, b_i))`` over the other
    positions j of the same story, and the same with the roles swapped
    (``max(0, margin + s(a_j, b_i) - s(a_i, b_i))``); s is the cosine.

    ``a``, ``b``: (B, G, C), pairs aligned by position; ``mask_a``/``mask_b``
    (B, G): positions that exist. Returns the mean over anchors that have at
    least one negative (each anchor's terms averaged first), the number of
    anchors whose positive scored highest, and the number of anchors."""
    a, b = F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1)
    s = torch.einsum("bic,bjc->bij", a, b)  # B G G
    positive = torch.diagonal(s, dim1=1, dim2=2)  # B G
    pair = mask_a.bool() & mask_b.bool()
    G = s.shape[1]
    off_diag = ~torch.eye(G, dtype=torch.bool, device=s.device)
    losses, correct, anchors = [], 0, 0
    # rows: anchor a_i against b_j; columns: anchor b_i against a_j
    for scores, neg_mask in ((s, mask_b), (s.transpose(1, 2), mask_a)):
        valid = pair.unsqueeze(2) & neg_mask.bool().unsqueeze(1) & off_diag  # B G G
        hinge = (margin + scores - positive.unsqueeze(2)).clamp(min=0) * valid
        n = valid.sum(dim=2)
        has = n > 0
        if has.any():
            losses.append((hinge.sum(dim=2)[has] / n[has]))
            masked = scores.masked_fill(~(valid | torch.diag_embed(pair)), float("-inf"))
            correct += int((masked.argmax(dim=2) == torch.arange(G, device=s.device))[has].sum())
            anchors += int(has.sum())
    if not losses:
        return s.new_zeros(()), 0, 0
    return torch.cat(losses).mean(), correct, anchors


def adaptation_loss(h: torch.Tensor, pooled: torch.Tensor, directions: dict[int, torch.Tensor],
                    image_mask: torch.Tensor, margin: float = 1.0) -> tuple[torch.Tensor, dict[str, int]]:
    """``h`` (B, G, H): the decoder's output at each sentence's start token
    (detached here: the decoder is not adapted); ``pooled`` (B, G, H): each
    image's visual encoding; ``directions[k]`` (B, G, H): image i's encoding
    through the direction-k linear, the token image i contributes to image
    i-k, so it is ranked against sentence i-k. The loss is the main hinge plus
    the mean of the direction hinges."""
    h = h.detach()
    loss, correct, n = ranking_hinge(pooled, h, image_mask, image_mask, margin)
    extra = []
    G = h.shape[1]
    for k, tokens in sorted(directions.items()):
        # Align: position m holds image m+k's direction-k token and sentence m.
        idx = torch.arange(G, device=h.device) + k
        inside = (idx >= 0) & (idx < G)
        shifted = tokens[:, idx.clamp(0, G - 1)]
        mask = image_mask.bool() & inside.unsqueeze(0) & image_mask.bool()[:, idx.clamp(0, G - 1)]
        value, _, anchors = ranking_hinge(shifted, h, mask, image_mask, margin)
        if anchors:
            extra.append(value)
    if extra:
        loss = loss + torch.stack(extra).mean()
    return loss, {"correct": correct, "n": n}
