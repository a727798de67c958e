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
    """The quantized linears on their exact float32 paths only: AMX's bf16 tiles and the
    integer one passes' rounded activations (VNNI's, AVX2's) capped off for the test, so two
    ways of computing the same layer can be compared to float32 rounding."""
    from engine.kernels import kernel_backend

    backend = kernel_backend()
    before = backend.isa
    exact = EXACT_BELOW.get(before)
    if exact is not None:
        backend.set_isa(exact)
    yield
    if exact is not None:
        backend.set_isa(before)


@pytest.fixture
def restores_activation_digits():
    """The kernels' digits per activation are process-wide and an engine sets them when it
    starts: back to the default after a test that asked for one digit."""
    yield
    from engine.kernels import kernel_backend

    kernel_backend().set_activation_digits(2)


# The highest instruction set under each one that rounds activations whose one pass is exact.
EXACT_BELOW = {"avx2-int16": "avx2", "vnni": "avx512", "amx": "avx512"}


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
