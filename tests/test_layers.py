import pytest

from eyas.config import ConfigError
from eyas.layers import default_aux_layers, resolve_aux_layers, to_sglang_ids


def test_eagle3_defaults():
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layers(61) == [2, 30, 58]  # Kimi-K2 / DeepSeek-V3
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(4) == [1, 2, 3]  # too shallow for the default: spread over 1..n-1
    for n in range(2, 80):
        ids = default_aux_layers(n)
        assert ids == sorted(set(ids)) and all(1 <= i <= n - 1 for i in ids)


def test_user_ids_are_validated():
    assert resolve_aux_layers([3, 10, 20], 30) == [3, 10, 20]
    assert resolve_aux_layers(None, 30) == [2, 15, 27]
    with pytest.raises(ValueError, match=r"out of range.*1\.\.29.*normed final state"):
        resolve_aux_layers([2, 15, 30], 30)
    with pytest.raises(ValueError, match="out of range"):
        resolve_aux_layers([0, 15], 30)
    with pytest.raises(ValueError, match="distinct and ascending"):
        resolve_aux_layers([15, 2], 30)
    with pytest.raises(ValueError, match="distinct and ascending"):
        resolve_aux_layers([2, 2, 27], 30)


def test_bad_ids_are_user_errors_naming_the_key():
    """ConfigError (not a bare ValueError) so that the CLI prints one line instead of a traceback."""
    for ids in ([2, 15, 30], [15, 2], []):
        with pytest.raises(ConfigError, match=r"^target\.aux_layers") as e:
            resolve_aux_layers(ids, 30)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="at least 2 layers"):
        default_aux_layers(1)


def test_sglang_convention_is_hf_minus_one():
    assert to_sglang_ids([2, 15, 27]) == [1, 14, 26]
    assert to_sglang_ids([3, 10, 20]) == [2, 9, 19]
