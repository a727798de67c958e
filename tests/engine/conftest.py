"""The tiny model the engine tests share (module-scoped: each test module builds its own)."""

import pytest

from engine.models.model_loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def ref() -> LoadedModel:
    """A second copy of the same weights, left on transformers' own attention."""
    return load_model("tiny-random")
