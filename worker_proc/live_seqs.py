"""The live sequences of one worker rank, kept in step with the scheduler by plan diffs.

A plan carries only what changed: sequences to drop, new sequences (tokens and sampling
settings, sent once), and the KV blocks each sequence gained. This module applies those
diffs to the host state and to the persistent per-slot device state, and checks a plan's
batch against what the worker knows. Any inconsistency is a ``PlanError``: a scheduler bug,
fatal to the worker, never retried.
"""

from __future__ import annotations

import itertools

import numpy as np

from pegainfer.protocol import NewSequence, StepPlan, unpack_ids
from worker_proc.batch import SequenceState
from worker_proc.penalties import PenaltyTable
from worker_proc.sampler import has_penalties
from worker_proc.seq_slots import SlotTable
from worker_proc.upload import Uploader


class PlanError(ValueError):
    """A step plan inconsistent with the worker's state: a scheduler bug, never retried."""


class LiveSequences:
    def __init__(
        self,
        slots: SlotTable,
        uploader: Uploader,
        vocab_size: int,
        num_kv_blocks: int,
        block_size: int,
        penalties: PenaltyTable | None = None,
        samples: bool = True,
    ) -> None:
        self.slots = slots
        self.uploader = uploader
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        # The rank that samples keeps each penalised sequence's token counts on the device.
        self.penalties = penalties
        # The rank that samples keeps each sleeping grammar's first mask on the device.
        self.samples = samples
        self.seqs: dict[int, SequenceState] = {}
        self._serials = itertools.count(1)

    def apply_diffs(self, plan: StepPlan) -> None:
        """Drop the finished sequences, add the new ones, append the new blocks."""
        if plan.finished_seq_ids:  # most steps drop nothing: skip the unpacking
            for seq_id in unpack_ids(plan.finished_seq_ids):
                self.drop(seq_id)
        for new in plan.new_seqs:
            self.add(new)
        if plan.block_updates:
            self.append_blocks([(u.seq_id, unpack_ids(u.block_ids)) for u in plan.block_updates])

    def add(self, new: NewSequence) -> None:
        if new.seq_id in self.seqs:
            raise PlanError(f"new sequence {new.seq_id} is already live")
        token_ids = unpack_ids(new.token_ids)
        if not token_ids:
            raise PlanError(f"new sequence {new.seq_id} has no tokens")
        vocab = self.vocab_size
        # On the packed bytes: a long prompt's range check is on its time to first token.
        packed = np.frombuffer(new.token_ids, dtype="<i4")
        if packed.min() < 0 or packed.max() >= vocab:
            raise PlanError(f"sequence {new.seq_id} has token ids outside [0, {vocab})")
        seq = self.seqs[new.seq_id] = SequenceState(
            seq_id=new.seq_id,
            token_ids=token_ids,
            num_prompt_tokens=new.num_prompt_tokens,
            sampling=new.sampling,
            slot=self.slots.allocate(),
            serial=next(self._serials),
        )
        if self.penalties is not None and has_penalties(new.sampling):
            seq.penalty_row = self.penalties.admit(token_ids, new.num_prompt_tokens)
        if new.first_mask and self.samples:
            words = np.frombuffer(new.first_mask, dtype="<i4")
            if len(words) * 32 < vocab:
                raise PlanError(f"sequence {new.seq_id}: a first mask of {len(words)} words")
            (seq.first_mask,) = self.uploader.upload([words.astype(np.int32)], persistent=True)

    def drop(self, seq_id: int) -> None:
        """Forget a sequence; unknown ids are ignored (it may have failed to start)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.slots.free(seq.slot)
            if seq.penalty_row >= 0 and self.penalties is not None:
                self.penalties.release(seq.penalty_row)

    def append_blocks(self, updates: list[tuple[int, list[int]]]) -> None:
        """Extend the host block tables and scatter the new entries into the device table,
        all of one plan in one upload."""
        flat_index: list[int] = []
        values: list[int] = []
        width = self.slots.max_blocks_per_seq
        num_kv_blocks = self.num_kv_blocks
        live = self.seqs
        for seq_id, block_ids in updates:
            seq = live.get(seq_id)
            if seq is None:
                raise PlanError(f"block update for unknown sequence {seq_id}")
            if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_kv_blocks):
                raise PlanError(
                    f"sequence {seq_id}: block ids outside [0, {num_kv_blocks}): {block_ids}"
                )
            table = seq.block_table
            start = len(table)
            end = start + len(block_ids)
            if end > width:
                raise PlanError(
                    f"sequence {seq_id}: {end} blocks exceed the {width} that --max-model-len needs"
                )
            table.extend(block_ids)
            first = seq.slot * width
            flat_index.extend(range(first + start, first + end))
            values.extend(block_ids)
        if flat_index:
            index, blocks = self.uploader.upload(
                [np.asarray(flat_index, dtype=np.int64), np.asarray(values, dtype=np.int32)]
            )
            self.slots.write_blocks(index, blocks)

    def batch(
        self, seq_ids: list[int], num_computed: list[int], num_scheduled: list[int]
    ) -> list[SequenceState]:
        """The step's sequences, after checking the plan's arrays against them."""
        if not len(seq_ids) == len(num_computed) == len(num_scheduled):
            raise PlanError(
                f"plan arrays differ in length: {len(seq_ids)} seq ids, "
                f"{len(num_computed)} num_computed, {len(num_scheduled)} num_scheduled"
            )
        if len(set(seq_ids)) != len(seq_ids):
            raise PlanError("a sequence appears twice in one step")
        seqs = []
        for seq_id, computed, scheduled in zip(seq_ids, num_computed, num_scheduled):
            seq = self.seqs.get(seq_id)
            if seq is None:
                raise PlanError(f"step schedules unknown sequence {seq_id}")
            if computed < 0 or scheduled <= 0:
                raise PlanError(
                    f"sequence {seq_id}: num_computed {computed}, num_scheduled {scheduled}"
                )
            end = computed + scheduled
            if end > seq.num_tokens:
                raise PlanError(
                    f"sequence {seq_id}: num_computed {computed} + num_scheduled {scheduled} "
                    f"exceeds its {seq.num_tokens} known tokens"
                )
            if end > len(seq.block_table) * self.block_size:
                raise PlanError(
                    f"sequence {seq_id}: {end} tokens need "
                    f"{-(-end // self.block_size)} blocks, it has {len(seq.block_table)}"
                )
            seqs.append(seq)
        return seqs
