"""qurl/corrections/spec.py, presets.py, registry.py: the config's objective settings come from LossSpec, its
choices from the registries, and a bad one is one line naming the key."""

from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from qurl.config import ConfigError, load_config
from qurl.corrections.compose import pieces
from qurl.corrections.presets import PRESETS
from qurl.corrections.registry import CLIPS, MASKS, OBJECTIVES, WEIGHTS, Registry
from qurl.corrections.spec import CONFIG_KEYS, LossSpec


def test_config_defaults_are_the_spec_defaults():
    algo = load_config(None, [], check_paths=False).algo
    assert LossSpec.from_config(algo) == LossSpec()


def test_a_field_the_config_lacks_fails_instead_of_taking_a_default():
    algo = OmegaConf.to_container(load_config(None, [], check_paths=False).algo)
    del algo["geo_mask_high"]
    with pytest.raises(AttributeError, match="geo_mask_high"):
        LossSpec.from_config(OmegaConf.create(algo))
    spec = LossSpec(mode="icepop", agg="seq-mean-token-mean", geo_mask_high=1.5)
    assert LossSpec.from_config(OmegaConf.create(spec.as_config())) == spec


def test_every_piece_reads_spec_fields_and_every_preset_resolves():
    names = {f.name for f in fields(LossSpec)}
    for registry in (WEIGHTS, MASKS, CLIPS, OBJECTIVES):
        for piece in registry.values():
            assert set(piece.reads) <= names, piece.name
            assert piece.doc, piece.name  # one line that says why, shown in docs/algorithms.md
    for name in PRESETS:
        pieces(LossSpec(mode=name))
    assert set(CONFIG_KEYS) <= names


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("algo.weight=importance", "algo.weight='importance' is not allowed; choose one of: none, token,"),
        ("algo.mask=kpop", "algo.mask='kpop' is not allowed; choose one of: none, token, sequence"),
        ("algo.clip=dppo", "algo.clip='dppo' is not allowed; choose one of: ppo, acr"),
        ("algo.loss=grpo", "algo.loss (loss mode) 'grpo' is not allowed; choose one of: ppo, decoupled"),
        ("algo.geo_mask_low=1.2", "algo.geo_mask_low/high = 1.2/1.1"),
        ("algo.veto_floor=0", "algo.veto_floor must be in (0, 1)"),
        ("algo.dual_clip=1", "algo.dual_clip must be > 1"),
    ],
)
def test_bad_objective_settings_are_one_line(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override], check_paths=False)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_name_registered_twice_is_refused():
    registry = Registry("algo.test")
    registry.register("a")(len)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a")(len)
