"""TAPM's visual encoder: per feature type a deep MLP encoder, neighbour
pooling across the story, projection to the decoder width, and the visual
prefix ``[cls] type1 tokens [sep] type2 tokens [sep]``."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DeepEncoder", "NeighbourPooling", "VisualEncoder"]


class _Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.LeakyReLU(), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class DeepEncoder(nn.Module):
    """Linear → width, LeakyReLU, Linear, LeakyReLU, then residual MLP blocks."""

    def __init__(self, in_dim: int, dim: int, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(in_dim, dim), nn.LeakyReLU(), nn.Linear(dim, dim), nn.LeakyReLU())
        self.blocks = nn.Sequential(*[_Residual(dim) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.inp(x))


class NeighbourPooling(nn.Module):
    """For image i of a story: a story-global token (a linear of the mean over
    the story's images) and one token per neighbour offset k (a linear per
    direction of image i+k's mean token; zero where i+k is outside the story),
    followed by image i's own tokens.

    ``x``: (B, G, L, C) encoded tokens; ``image_mask``: (B, G) True for the
    story's real images (stories of different lengths are padded at the end).
    Returns (B, G, 1 + len(offsets) + L, C)."""

    def __init__(self, dim: int, offsets: list[int]) -> None:
        super().__init__()
        self.offsets = list(offsets)
        self.global_linear = nn.Linear(dim, dim)
        # ModuleDict keys must be strings; "m2" = two images back.
        self.direction = nn.ModuleDict({self._key(k): nn.Linear(dim, dim) for k in self.offsets})

    @staticmethod
    def _key(offset: int) -> str:
        return f"m{-offset}" if offset < 0 else f"p{offset}"

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
        B, G, L, C = x.shape
        mask = image_mask.to(x.dtype)  # B G
        per_image = x.mean(dim=2)  # B G C
        count = mask.sum(dim=1, keepdim=True).clamp(min=1)
        story_mean = (per_image * mask.unsqueeze(-1)).sum(dim=1) / count  # B C
        tokens = [self.global_linear(story_mean).unsqueeze(1).expand(B, G, C)]
        positions = torch.arange(G, device=x.device)
        for k in self.offsets:
            projected = self.direction[self._key(k)](per_image)  # B G C
            source = positions + k
            inside = (source >= 0) & (source < G)
            gathered = projected[:, source.clamp(0, G - 1)]  # B G C: image i+k's token at i
            valid = inside.unsqueeze(0) & image_mask.bool()[:, source.clamp(0, G - 1)]
            tokens.append(gathered * valid.unsqueeze(-1).to(x.dtype))
        context = torch.stack(tokens, dim=2)  # B G (1+K) C
        return torch.cat((context, x), dim=2)

    def direction_tokens(self, pooled: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each direction's linear applied to per-image vectors (B, G, C): the
        token image i contributes to image i-k (for the adaptation loss)."""
        return {k: self.direction[self._key(k)](pooled) for k in self.offsets}


class VisualEncoder(nn.Module):
    """All feature types of a story → per-image visual prefixes in the
    decoder's width, plus the per-image pooled encodings the adaptation loss
    compares with the decoder's states."""

    def __init__(self, feature_dims: dict[str, int], width: int, hidden_size: int, offsets: list[int],
                 blocks: int = 3, dropout: float = 0.5) -> None:
        super().__init__()
        self.types = list(feature_dims)
        self.encoders = nn.ModuleDict({t: DeepEncoder(d, width, blocks) for t, d in feature_dims.items()})
        self.pooling = nn.ModuleDict({t: NeighbourPooling(width, offsets) for t in feature_dims})
        self.project = nn.Linear(width, hidden_size) if width != hidden_size else nn.Identity()
        # Learned [cls]/[sep] embeddings instead of new vocabulary entries: the
        # decoder's embedding matrix stays untouched (frozen, or quantised).
        self.cls = nn.Parameter(torch.randn(hidden_size) * 0.02)
        self.sep = nn.Parameter(torch.randn(hidden_size) * 0.02)
        self.dropout = nn.Dropout(dropout)

    def forward(self, features: dict[str, torch.Tensor], image_mask: torch.Tensor):
        """``features[type]``: (B, G, L_type, D_type). Returns ``prefix`` (B, G,
        P, H), ``pooled`` (B, G, H): per image, the sum over types of the mean
        of its pooled tokens, and ``directions`` {offset: (B, G, H)}."""
        parts, pooled, directions = [], 0, {}
        B, G = image_mask.shape
        for t in self.types:
            if t not in features:
                raise ValueError(f"TAPM: missing visual features of type {t!r} (have {', '.join(features)})")
            encoded = self.encoders[t](features[t])
            tokens = self.project(self.pooling[t](encoded, image_mask))
            parts += [tokens, self.sep.expand(B, G, 1, -1)]
            pooled = pooled + tokens.mean(dim=2)
            for k, d in self.pooling[t].direction_tokens(encoded.mean(dim=2)).items():
                directions[k] = directions.get(k, 0) + self.project(d)
        prefix = torch.cat([self.cls.expand(B, G, 1, -1), *parts], dim=2)
        return self.dropout(prefix), pooled, directions
