import pytest

from vca_patch import ConfigError, TargetConfig, VCAConfig


def test_round_trips_through_json():
    config = VCAConfig(contrast_tokens=16, softmax="separate", init="paper", layers=[3, 1, 3], seed=7)
    assert config.layers == [1, 3]
    again = TargetConfig.from_json(config.to_json())
    assert again == config and isinstance(again, VCAConfig)
    assert VCAConfig.from_dict(config.to_dict()) == config
    assert config.contrast_grid == (4, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"contrast_tokens": 48}, "perfect square"),
        ({"contrast_tokens": 0}, "perfect square"),
        ({"softmax": "both"}, "'joint' or 'separate'"),
        ({"init": "zeros"}, "'preserve' or 'paper'"),
        ({"layers": [-1]}, "non-negative"),
        ({"layers": "0-3"}, "non-negative"),
        ({"rms_eps": 0}, "positive"),
        ({"seed": 1.5}, "integer"),
    ],
)
def test_invalid_values_are_rejected(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        VCAConfig(**kwargs)


def test_unknown_keys_and_targets_are_named():
    with pytest.raises(ConfigError, match=r"unknown VCAConfig keys \['tokens'\]; valid keys: .*contrast_tokens"):
        VCAConfig.from_dict({"tokens": 49})
    with pytest.raises(ConfigError, match="unknown target 'flash'"):
        TargetConfig.from_dict({"target": "flash"})
