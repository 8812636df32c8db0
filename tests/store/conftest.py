"""Fixtures for store tests."""

import pytest
from store_helpers import make_prepared


@pytest.fixture
def prepared(tmp_path):
    return make_prepared(tmp_path / "prepared")
