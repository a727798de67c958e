"""What a generated token stream means, apart from how it travels: the sampling parameters (one
type from the gateway's request to the engine's sampler), structured-output grammars, the
incremental detokenizer, reasoning parsers, and the prompt's block hashes (one function for the
scheduler's prefix cache and the gateway's placement). The offline engine, the gateway and the
worker import it; it imports none of them, nor the wire layer (tests/test_layers.py checks
that)."""

from generation.sampling_params import SamplingParams  # noqa: F401
