"""The end of a step on the worker: drawing its tokens from the logits, and queueing them
for the host and for the next step's inputs.

A part of ``ModelRunner`` (model_runner.py), which owns the state named below. A step whose
plan says ``masks_follow`` stops before its draw: its forward pass is queued on the device,
and the draw runs when the scheduler's StepMasks for it arrives (``supply_masks``), which
the scheduler sends as soon as the tokens its grammars needed have come back. The GPU runs
the forward pass meanwhile, so the masks cost the step nothing unless they come later than
it ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pegainfer.protocol import StepMasks, StepPlan, unpack_ids
from worker_proc.batch import SequenceState
from worker_proc.live_seqs import PlanError
from worker_proc.logit_edits import StopMasks, allowed_tokens, first_masks, gated_bans
from worker_proc.logprobs import LogprobsCollector
from worker_proc.model_config import ModelConfig
from worker_proc.parallel_state import broadcast_from_rank0
from worker_proc.penalties import PenaltyTable
from worker_proc.sampler import Sampler, SamplingBatch
from worker_proc.seq_slots import SlotTable
from worker_proc.step_results import ResultQueue
from worker_proc.upload import Uploader


class StepDraw:
    # The ModelRunner's state that a draw reads and changes.
    rank: int
    device: torch.device
    model_config: ModelConfig
    sampler: Sampler
    penalties: PenaltyTable | None
    stop_masks: StopMasks
    logprobs: LogprobsCollector
    results: ResultQueue
    slots: SlotTable
    uploader: Uploader
    _sampling_cache: tuple[tuple[int, ...], SamplingBatch] | None
    # A step whose forward pass is queued and whose draw waits for its grammar masks:
    # (step id, its masked seq ids, the draw).
    _awaiting_masks: tuple[int, bytes, Callable[[bytes, bytes], None]] | None

    @torch.inference_mode()
    def supply_masks(self, masks: StepMasks) -> None:
        """The token masks the step waiting for them draws with; it samples now."""
        awaiting = self._awaiting_masks
        if awaiting is None or awaiting[0] != masks.step_id:
            raise PlanError(f"token masks for step {masks.step_id}, which does not wait for any")
        if masks.masked_seq_ids != awaiting[1]:
            raise PlanError(f"step {masks.step_id}'s masks are for other rows than its plan's")
        self._awaiting_masks = None
        awaiting[2](masks.masked_seq_ids, masks.token_bitmask)

    def _sample(
        self,
        step_id: int,
        logits: torch.Tensor,
        greedy_tokens: torch.Tensor | None,
        samplers: list[SequenceState],
        sample_pos: torch.Tensor,
        sample_slot: torch.Tensor,
        plan: StepPlan | None,
        masked_seq_ids: bytes,
        token_bitmask: bytes,
    ) -> None:
        """Draw the step's tokens, and queue them for the host and the next step's inputs.
        ``plan`` brings the step's bad-word bans and the rows whose grammar may wake."""
        batch = self._sampling_batch(samplers)
        if self.rank == 0:
            vocab_size = logits.shape[1]
            allowed = (
                allowed_tokens(
                    unpack_ids(masked_seq_ids), token_bitmask, samplers, vocab_size, self.uploader
                )
                if masked_seq_ids
                else None
            )
            gated = banned = None
            if plan is not None and plan.gated_seq_ids:
                gated = first_masks(unpack_ids(plan.gated_seq_ids), samplers, self.uploader)
            if plan is not None and plan.ban_seq_ids:
                fields = (plan.ban_seq_ids, plan.ban_token_ids, plan.ban_gates)
                banned = gated_bans(*(unpack_ids(f) for f in fields), samplers, self.uploader)
            # Before this step's tokens overwrite the last tokens the gates compare.
            for edit in (gated, banned):
                if edit is not None:
                    edit.open_gates(self.slots.last_token, sample_slot)
            tokens = self.sampler.sample(
                logits,
                batch,
                sample_pos,
                self.penalties,
                greedy_tokens=greedy_tokens,
                stop_mask=self.stop_masks.for_step(),
                allowed=allowed,
                bans=banned,
                gated=gated,
            )
        else:  # rank 0's tokens are the tokens; the others receive them (parallel_state)
            tokens = torch.empty(len(samplers), dtype=torch.int64, device=self.device)
        tokens = broadcast_from_rank0(tokens)
        if self.rank == 0:
            self.logprobs.sampled_step(step_id, logits, tokens, samplers)
        for seq in samplers:
            seq.num_tokens += 1
        # The tokens go to the host and into the slots' last tokens, which the next step's
        # inputs read, in one launch.
        self.results.push(step_id, samplers, tokens, self.slots.last_token, sample_slot)

    def _sampling_batch(self, samplers: list[SequenceState]) -> SamplingBatch:
        key = tuple(s.serial for s in samplers)
        if self._sampling_cache is None or self._sampling_cache[0] != key:
            batch = self.sampler.prepare(
                [s.sampling for s in samplers],
                self.model_config.vocab_size,
                [s.penalty_row for s in samplers],
            )
            self._sampling_cache = (key, batch)
            self.stop_masks.compose(samplers)
        return self._sampling_cache[1]
