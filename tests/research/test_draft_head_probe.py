"""research/draft_head_probe.py, small: the training prompts, which steps count as lookup-less, a
head that learns, and the whole probe on the tiny random model."""

from __future__ import annotations

import ast
import io
import json

import torch

from engine.models.model_loader import load_model
from research import draft_head_probe as probe
from research.quoting_trace import CODE, CONTACTS, REPORT
from research.speculation_ceiling import Lookup


def test_training_prompts_are_fixed_and_none_is_the_trace_s():
    prompts = probe.training_prompts(20)
    assert prompts == probe.training_prompts(20) and len(prompts) == 20
    assert sum("Attendees:" in p for p in prompts) == 4  # a fifth are contact lists
    for text in (CODE.splitlines()[0], REPORT[:40], CONTACTS[:40]):
        assert not any(text in p for p in prompts)


def test_a_source_segment_is_the_ast_module_s():
    # Line ends of every kind, a form feed (not a line end to ast), non-ASCII columns (offsets
    # count bytes), one-line and many-line nodes.
    source = (
        "def f(x):\r\n    s = 'é' + x  # ü\r\n\x0c\n    return s\n"
        "class C:\r    def g(self): return 'ß'\n\n"
        "    def h(self,\n          y):\n        return y\n"
    )
    lines = io.StringIO(source, newline="").readlines()
    nodes = [n for n in ast.walk(ast.parse(source)) if getattr(n, "end_lineno", None)]
    assert len(nodes) > 15
    for node in nodes:
        assert probe.source_segment(lines, node) == ast.get_source_segment(source, node)


def test_lookup_less_rows_are_the_steps_prompt_lookup_has_nothing_for():
    prompt, reply = [5, 6, 7, 8], [1, 2, 5, 6, 7, 8, 3]
    f = probe.Features(
        torch.zeros(len(reply) - 1, 1),
        torch.tensor(reply[:-1]),
        torch.tensor(reply[1:]),
        [(0, j) for j in range(len(reply) - 1)],
    )
    # Steps start at reply indices 0, 1, 2, 3 (one token each: nothing looked up), then 4: the
    # tail (5, 6) is in the prompt and its 7, 8 are kept. The first step has no t to read.
    rows = probe.lookup_less_rows([(prompt, reply)], f, Lookup(7, 2, 4))
    assert rows.tolist() == [0, 1, 2]
    assert f.target[rows].tolist() == [2, 5, 6]


def test_the_head_learns_the_replies_it_is_trained_on():
    loaded = load_model("tiny-random")
    model = loaded.model
    torch.manual_seed(0)
    pairs = [
        (torch.randint(3, 200, (6,)).tolist(), torch.randint(3, 200, (12,)).tolist())
        for _ in range(6)
    ]
    f = probe.features(model, pairs)
    assert f.hidden.shape == (6 * 11, model.config.hidden_size)
    assert f.where[:2] == [(0, 0), (0, 1)] and f.target[0] == pairs[0][1][1]
    embed = model.get_input_embeddings().weight.detach().float()
    head = probe.DraftHead(embed, model.get_output_embeddings().weight.detach().float(), 128)
    before = head.accuracy(f)
    probe.train(head, f, epochs=400)
    assert head.accuracy(f) > max(0.5, before + 0.3)


def test_the_probe_runs_end_to_end_on_the_tiny_model(tmp_path):
    tokenizer = load_model("tiny-random").tokenizer
    prompt = tokenizer.encode("copy this: alpha beta gamma delta", add_special_tokens=False)
    trace = tmp_path / "trace.json"
    requests = [{"id": i, "prompt_ids": prompt, "output_len": 16} for i in range(2)]
    trace.write_text(json.dumps({"requests": requests}))
    out = tmp_path / "probe.json"
    flags = ["--model", "tiny-random", "--trace", str(trace), "--prompts", "5"]
    flags += ["--max-tokens", "8", "--epochs", "1", "--width", "32", "--threads", "1"]
    result = probe.main([*flags, "--output", str(out)])
    assert result == json.loads(out.read_text())
    assert result["training replies"] == 5 and result["trace positions"] == 2 * 15
    assert 0 < result["steps without a lookup draft"] <= result["replayed steps"]
    assert 0 <= result["trace accuracy"] <= 1
