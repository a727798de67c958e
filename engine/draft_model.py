"""A draft model's proposals (`--speculative-model`): a small model with the target's tokenizer,
run greedily by the engine's own machinery (a ModelRunner, a paged KV cache, a KVBlockManager)
on a KV pool of its own, taken out of the KV budget (engine/capacity.py).

Before each step is planned, `draft` computes the drafts of every sequence that may verify in it,
batched across them, one forward per draft position:
1. each such sequence's mirror (the draft's own `Sequence`: the target's prompt and output, then
   its proposals) is synced with the target: its K/V stays for the longest prefix whose tokens
   still equal the target's (the drafts a verification kept) and the rest is trimmed;
2. the first pass catches every mirror up to the target's last token (that one always: its
   logits give draft 1), whatever it has not seen: the step's correction or bonus token, the
   whole prompt the first time, tokens decoded while the batch was too large to speculate;
3. each later pass feeds the previous draft and gives the next, for the mirrors that want more.
How many each may want, and how many pay, `draft` reads from the policy's Speculator (its
settings, odds and row cost: scheduler/speculation/speculator.py), passed in each round. The
policy then reads them through the proposer seam (`propose`) and verifies what fits the step.
A mirror is dropped when its sequence leaves the batch (finished, preempted, aborted:
`forget`); a worker taking a request over starts without one and catches it up from the prompt
like any new mirror.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from collections.abc import Sequence as SequenceABC

from engine.config import EngineConfig
from engine.kv_cache import PagedKVCache
from engine.models.model_loader import LoadedModel, Progress, load_model
from engine.runner.model_runner import ModelRunner, resolve_forward
from engine.sampler import sample
from engine.startup import decode_attention_for, kv_cache_spec
from generation.sampling_params import SamplingParams
from scheduler import BlockIntegrityError, KVBlockManager, ScheduledChunk, Sequence, StepPlan
from scheduler.speculation import MODEL_KIND, Proposal, Speculator

logger = logging.getLogger("jitney.engine.draft")

_GREEDY = SamplingParams(temperature=0.0)


class DraftModelError(ValueError):
    """A draft model that cannot serve the target (refused at start)."""


def load_draft_model(
    config: EngineConfig, target: LoadedModel, progress: Progress | None = None
) -> LoadedModel | None:
    """The draft model `config` names, checked against `target` (None: no draft model). The
    target named as its own draft shares its weights."""
    name = config.speculative.model
    if name is None:
        return None
    if name == config.model:
        draft = target
    else:
        device, dtype = config.torch_device, config.torch_dtype
        draft = load_model(name, device, dtype, config.cache_dir, progress)
    check_same_vocabulary(target, draft)
    return draft


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft's token ids must mean the target's text: the same tokenizer vocabulary."""
    mine, theirs = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if mine == theirs:
        return
    differ = sorted(t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t))
    raise DraftModelError(
        f"draft model {draft.name!r} does not share the tokenizer of {target.name!r}: "
        f"{len(mine)} tokens against {len(theirs)}, {len(differ)} of them different "
        f"(e.g. {differ[0]!r}); a draft model must have the target's vocabulary"
    )


class DraftModel:
    """The `Proposer` the continuous policy asks while it plans a step: drafts computed before
    the plan by `draft`, per sequence."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        kv_bytes: int,
        vocab_size: int,
    ):
        device = config.torch_device
        # Its weights as --quantization auto would keep them (dense in the exact mode).
        quantization = "none" if config.quantization == "none" else "auto"
        self.forward_name, forward = resolve_forward(loaded, config.model_impl, quantization)
        spec = kv_cache_spec(config, loaded, self.forward_name)
        num_blocks = kv_bytes // spec.bytes_per_block
        if num_blocks < 1:
            raise DraftModelError(
                f"the draft model's KV pool ({kv_bytes} B) holds no block of "
                f"{spec.bytes_per_block} B: raise --speculative-kv-cache-memory"
            )
        kernel, _ = decode_attention_for(config, device, loaded.config, spec)
        self.runner = ModelRunner(forward, PagedKVCache(spec, num_blocks, device, kernel))
        self.kv = KVBlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.name = loaded.name
        self.max_model_len = loaded.max_model_len
        self.max_catch_up_tokens = config.max_num_batched_tokens  # per step, over all mirrors
        self.vocab_size = vocab_size  # the target's: ids past it (a padded head's) never proposed
        self.seqs: dict[str, Sequence] = {}  # the mirrors, by the target sequence's id
        self._synced: dict[str, int] = {}  # a mirror's output tokens known to equal the target's
        self._proposed: dict[str, list[int]] = {}
        logger.info(
            "draft model %s (%s): %d KV blocks x %d tokens",
            self.name,
            self.forward_name,
            num_blocks,
            config.block_size,
        )

    # ----- the proposer seam (scheduler/speculation/proposer.py) ----------------------------
    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        return Proposal(self._proposed.get(seq.seq_id, [])[:max_tokens], MODEL_KIND)

    # ----- one round, before the step is planned --------------------------------------------
    def draft(self, running: SequenceABC[Sequence], speculator: Speculator) -> None:
        """Propose for every running sequence that may verify in the next step, as many
        drafts as it may verify there at most (SpeculativeConfig.num_drafts) and as the
        policy's `speculator` says pay: passes past them are not run."""
        self._proposed = {}
        if not speculator.config.batch_speculates(len(running)):
            return
        wanted = [(seq, self._num_drafts(seq, len(running), speculator)) for seq in running]
        wanted = [(seq, k) for seq, k in wanted if k > 0]
        if not wanted:
            return
        going = self._catch_up(wanted)
        for j in range(1, max((k for _, k in going), default=0)):
            self._extend([mirror for mirror, k in going if k > j])

    def _num_drafts(self, seq: Sequence, rows: int, speculator: Speculator) -> int:
        # The draft computes positions up to num_tokens + k - 2: within its own context.
        k = min(speculator.config.num_drafts(seq, rows), self.max_model_len - seq.num_tokens)
        # As many as pay at this batch (`rows`: one per running sequence); at least the first,
        # which the catch-up pass gives anyway (and the policy's probe may verify).
        own = seq.speculation.draft_counts
        paying = speculator.odds.paying(MODEL_KIND, k, speculator.break_even(rows), own)
        return min(k, max(paying, 1))

    def _catch_up(self, wanted: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The first pass: each mirror computes what it has not seen, within the per-step
        budget; those that reach the target's last token get draft 1. Returns them, with the
        drafts each wants (slots for the drafts fed back later are allocated now)."""
        plan, going, budget = StepPlan(), [], self.max_catch_up_tokens
        for seq, k in wanted:
            mirror = self._synced_mirror(seq)
            num_new = mirror.num_tokens - self.kv.num_cached_tokens(mirror)
            take = min(num_new, budget)
            whole = take == num_new
            if take < 1 or not self._allocate(mirror, take + (k - 1 if whole else 0), wanted):
                continue
            start = mirror.num_computed_tokens  # (past prefix-cache hits on a first allocation)
            # One token, the last: a decode row (it feeds the mirror's last token).
            is_prefill = not (whole and take == 1)
            plan.chunks.append(ScheduledChunk(seq.seq_id, start, take, whole, is_prefill))
            budget -= take
            if whole:
                going.append((mirror, k))
        picks = iter(self._run(plan))
        for chunk in plan.chunks:
            mirror = self.seqs[chunk.seq_id]
            mirror.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.commit_computed(mirror)
            if chunk.samples:
                token = next(picks)
                mirror.output_token_ids.append(token)
                self._proposed[chunk.seq_id] = [token]
        return going

    def _extend(self, mirrors: list[Sequence]) -> None:
        """A later pass: each mirror feeds its last draft (a decode row) and proposes the next."""
        plan = StepPlan(
            [ScheduledChunk(m.seq_id, m.num_computed_tokens, 1, True, False) for m in mirrors]
        )
        for mirror, token in zip(mirrors, self._run(plan), strict=True):
            mirror.num_computed_tokens += 1
            mirror.output_token_ids.append(token)
            self._proposed[mirror.seq_id].append(token)

    def _run(self, plan: StepPlan) -> list[int]:
        """The greedy pick of every chunk that samples, in chunk order."""
        if plan.is_empty:
            return []
        inputs = self.runner.prepare(plan, self.seqs, self.kv.block_ids)
        logits, _ = self.runner.forward(inputs)
        logits = logits[:, : self.vocab_size]
        return sample(logits, [_GREEDY] * len(logits), [0] * len(logits))

    def _synced_mirror(self, seq: Sequence) -> Sequence:
        """`seq`'s mirror, its output made the target's again and its K/V trimmed to the tokens
        both still share (never the last one: the first pass computes it for its logits)."""
        mirror = self.seqs.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(
                seq.seq_id,
                seq.prompt_token_ids,
                seq.limits,
                output_token_ids=list(seq.output_token_ids),
                prompt_block_hashes=seq.prompt_block_hashes,
            )
            self.seqs[seq.seq_id] = mirror
            self._synced[seq.seq_id] = seq.num_output_tokens
            return mirror
        mine, theirs = mirror.output_token_ids, seq.output_token_ids
        same, end = self._synced[seq.seq_id], min(len(mine), len(theirs))
        while same < end and mine[same] == theirs[same]:
            same += 1
        del mine[same:]
        mine += theirs[same:]
        self._synced[seq.seq_id] = len(theirs)
        keep = min(
            mirror.num_computed_tokens, mirror.num_prompt_tokens + same, mirror.num_tokens - 1
        )
        if keep < mirror.num_computed_tokens:
            mirror.num_computed_tokens = keep
            self.kv.trim(mirror, keep)
        return mirror

    def _allocate(self, mirror: Sequence, num_new: int, wanted: list[tuple[Sequence, int]]) -> bool:
        """Slots for `num_new` more tokens of `mirror`; when the pool is full, the mirrors of
        sequences that do not speculate this step make room (they catch up again later)."""
        if self.kv.allocate_slots(mirror, num_new):
            return True
        drafting = {seq.seq_id for seq, _ in wanted}
        for seq_id in [i for i in self.seqs if i not in drafting]:
            self.forget(seq_id)
            if self.kv.allocate_slots(mirror, num_new):
                return True
        return False

    # ----- sequences leaving the batch ------------------------------------------------------
    def forget(self, seq_id: str) -> None:
        """Drop a sequence's mirror and give its blocks back (finished, preempted, aborted)."""
        mirror = self.seqs.pop(seq_id, None)
        if mirror is not None:
            self.kv.free(mirror)
            del self._synced[seq_id]
        self._proposed.pop(seq_id, None)

    def reset(self) -> None:
        """Drop every mirror and start from a fresh pool (after a failed step: a round that
        raised may have left the accounting half-updated; the KV tensors are reused)."""
        self.seqs.clear()
        self._synced.clear()
        self._proposed = {}
        kv = self.kv
        self.kv = KVBlockManager(kv.num_blocks, kv.block_size, kv.enable_prefix_caching)

    def check_integrity(self, live: Collection[str]) -> None:
        """The pool's invariants, and blocks held only by mirrors of `live` sequences, each
        with slots for the tokens it computed."""
        self.kv.check_integrity()
        stray = sorted(set(self.seqs) - set(live))
        if stray:
            raise BlockIntegrityError(f"draft mirrors of sequences that left the batch: {stray}")
        if not self.seqs and self.kv.num_used_blocks:
            raise BlockIntegrityError(f"draft pool: {self.kv.num_used_blocks} blocks unowned")
        for seq_id, mirror in self.seqs.items():
            slots = len(self.kv.block_table(seq_id)) * self.kv.block_size
            if mirror.num_computed_tokens > slots:
                raise BlockIntegrityError(
                    f"draft mirror {seq_id}: {mirror.num_computed_tokens} tokens computed "
                    f"in {slots} slots"
                )
