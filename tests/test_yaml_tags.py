"""A config file cannot build Python objects: YAML tags such as !!python/object are refused, nothing runs."""

import pytest

from eyas.config import ConfigError, load_config


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system", "!!python/name:os.system"])
def test_a_python_tag_in_a_config_is_refused_and_never_runs(tmp_path, tag):
    marker = tmp_path / "ran"
    config = tmp_path / "evil.yaml"
    config.write_text(f"name: x\ntrain:\n  lr: {tag} ['touch {marker}']\n")
    with pytest.raises(ConfigError):
        load_config(str(config))
    assert not marker.exists()
