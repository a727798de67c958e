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


@pytest.fixture
def exact_linears():
    """The quantized linears on their exact float32 paths only: AMX's bf16 tiles and the VNNI
    one pass's int8 activations capped off for the test (a machine without them never takes
    them), so two ways of computing the same layer can be compared to float32 rounding."""
    from engine.kernels import kernel_backend

    backend = kernel_backend()
    before = backend.isa
    if before in ("vnni", "amx"):
        backend.set_isa("avx512")
    yield
    if before in ("vnni", "amx"):
        backend.set_isa(before)


def _available_isas() -> tuple[str, ...]:
    from engine.kernels import kernel_backend

    return kernel_backend().available_isas()


@pytest.fixture(params=_available_isas() or [None])
def isa(request):
    """Each instruction set this CPU gives the C++ kernels, in turn (None: the reference only);
    the kernels' cap is restored after."""
    from engine.kernels import kernel_backend

    backend = kernel_backend()
    if request.param is None:
        yield None
        return
    before = backend.isa
    yield backend.set_isa(request.param)
    backend.set_isa(before)
