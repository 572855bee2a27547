"""Named objectives as choices of pieces: qurl's four modes and the peers' recipes under recognisable names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """One `algo.loss` value: the objective and its default pieces (algo.weight / mask / clip override them)."""

    objective: str  # clip | gspo | cispo
    weight: str
    mask: str
    clip: str
    bypass: bool = False  # the ratio is against the behaviour policy (no proximal forward matters): naive PPO


PRESETS: dict[str, Preset] = {
    "ppo": Preset("clip", "none", "none", "ppo", bypass=True),  # naive: verl bypass_ppo_clip, slime rollout logprobs
    "decoupled": Preset("clip", "token", "none", "ppo"),  # 3-policy PPO, untruncated rho
    "tis": Preset("clip", "token-truncate", "none", "ppo"),  # verl decoupled_token_is, FlashRL, slime --use-tis
    "acr": Preset("clip", "token-truncate", "none", "acr"),  # QuRL
    "icepop": Preset("clip", "token", "token", "ppo"),  # IcePop: rho inside [low, high], else 0
    "geo-rs": Preset("clip", "none", "geometric", "ppo"),  # verl decoupled_geo_rs, NeMo seq-mask, SkyRL geometric
    "seq-mis": Preset("clip", "sequence-truncate", "sequence", "ppo"),  # verl decoupled_seq_is_rs (Seq-MIS)
    "gspo": Preset("gspo", "none", "none", "ppo"),
    "cispo": Preset("cispo", "none", "none", "ppo"),
}
MODES = ("ppo", "decoupled", "tis", "acr")  # qurl's modes before the pieces existed; each equals its preset
