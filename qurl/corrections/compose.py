"""A LossSpec's pieces, looked up once: the preset's, with algo.weight / mask / clip overriding them."""

from __future__ import annotations

from dataclasses import dataclass

from qurl.corrections import clips, masks, objectives, weights  # noqa: F401  (each fills its registry)
from qurl.corrections.presets import PRESETS
from qurl.corrections.registry import CLIPS, MASKS, OBJECTIVES, WEIGHTS, Piece


@dataclass(frozen=True)
class Pieces:
    objective: Piece
    weight: Piece
    mask: Piece
    clip: Piece
    bypass: bool

    @property
    def reads(self) -> set[str]:
        """The LossSpec settings these pieces use."""
        return {r for p in (self.objective, self.weight, self.mask, self.clip) for r in p.reads}


def pieces(spec) -> Pieces:
    """The spec's pieces; one line naming the key when a name is not registered."""
    preset = PRESETS[spec.mode]
    return Pieces(
        OBJECTIVES.choose(preset.objective),
        WEIGHTS.choose(spec.weight or preset.weight),
        MASKS.choose(spec.mask or preset.mask),
        CLIPS.choose(spec.clip or preset.clip),
        preset.bypass,
    )
