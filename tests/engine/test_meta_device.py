"""A step on a device that is not the CPU, checked on the CPU: the `meta` device holds shapes
without data, so a tensor left on the CPU beside it fails the op that mixes them, and a value
read back to the host fails at the read. A GPU fails the first way too, and pays the second with
a wait for the whole queued forward. The first lent H200 found one of each (2026-12-04): the
rotary's inverse frequencies left on the CPU, and a host scalar copied in the sampler."""

from __future__ import annotations

import traceback

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from engine.sampler import TokenHistory, adjust_logits, with_seed
from generation import SamplingParams

META = torch.device("meta")
ADJUSTING = SamplingParams(
    temperature=0.8,
    top_k=20,
    top_p=0.9,
    frequency_penalty=0.5,
    presence_penalty=0.2,
    repetition_penalty=1.1,
    logit_bias=((7, 2.0),),
    min_tokens=4,
)


def innermost_repository_frame(error: BaseException) -> traceback.FrameSummary:
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/site-packages/" not in f.filename]
    return ours[-1]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=4, temperature=0), ADJUSTING],
    ids=["greedy", "sampled-and-adjusted"],
)
def test_a_step_off_the_cpu_reads_nothing_back_before_the_sampled_ids(params):
    """Prefill chunks, the forward on Jitney's own path, the paged KV write and attention, the
    logits adjustments and the draws all run on the meta device; the step's one read is the
    sampled ids' transfer at the end of `sample`."""
    loaded = load_model("tiny-random", META)
    config = EngineConfig(
        model="tiny-random",
        device="meta",
        kv_cache_memory="4MiB",
        max_num_seqs=4,
        max_num_batched_tokens=24,  # two requests' prompts, the second one chunked
        enforce_eager=True,
    )
    engine = Engine(config, loaded=loaded)
    assert engine.view.forward_name == "jitney-none"
    for i in range(2):
        engine.add_request(str(i), list(range(5 + i, 25 + i)), with_seed(params))
    with pytest.raises(NotImplementedError, match="meta tensor") as raised:
        while True:  # the first chunk samples nothing: the second step reaches the sampler
            engine.step()
    frame = innermost_repository_frame(raised.value)
    assert (frame.filename.endswith("engine/sampler.py"), frame.name) == (True, "sample")
    assert frame.line is not None and frame.line.rstrip().endswith(".tolist()")


def test_the_logits_adjustments_stay_on_the_device():
    logits = torch.empty(3, 64, device=META)
    histories = [TokenHistory([1, 2, 3], [4, 5], (2,)) for _ in range(3)]
    adjusted = adjust_logits(logits, [ADJUSTING] * 3, histories)
    assert adjusted.device == META and adjusted.shape == (3, 64)
