"""Putting requests into a step: every running request, oldest first, then each newly
admitted one (``Scheduler.schedule`` calls both).

A part of ``Scheduler`` (scheduler.py), which owns the state named below; kept apart because
every decode step runs the running requests' loop over the whole batch, so it is written for
speed: locals only, with the rare cases (new blocks, preemption, prompt chunks) off the
common path.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request, RequestStatus
from scheduler_proc.step_builder import StepBuilder


class StepPlanning:
    # The Scheduler's state that planning reads and changes.
    _running: list[Request]
    block_manager: BlockManager
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    prompt_tokens_computed: int

    # Methods of the other parts (annotations only: nothing here shadows them).
    _preempt: Callable[[Request], None]

    def _plan_running(
        self, batch: StepBuilder, unindexed: list[Request] | None
    ) -> tuple[int, bool]:
        """Plan the running requests, oldest first: the token budget left, and whether a
        request was preempted. A request short of blocks takes them from the youngest, which
        is therefore never one already planned in this step.

        Every decode step runs this loop over the whole batch, so it works on locals and
        keeps the rare cases (new blocks, preemption, prompt chunks) off the common path."""
        budget = self.max_num_batched_tokens
        running = self._running
        block_size = self.block_size
        max_model_len = self.max_model_len
        block_manager = self.block_manager
        add_seq_id = batch.seq_ids.append
        add_computed = batch.num_computed.append
        add_scheduled = batch.num_scheduled.append
        add_sampler = batch.samplers.append
        add_request = batch.requests.append
        preempted = False
        prompt_tokens_computed = 0
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            index += 1
            computed = request.num_computed_tokens
            pending = request.num_pending_tokens
            num_output = len(request.output_token_ids)
            num_prompt = request.num_prompt_tokens
            known = num_prompt + num_output + pending  # the length the workers know
            if pending > 0 and (
                num_output + pending >= request.sampling.max_tokens
                or known >= max_model_len
                or (pending > 1 and request.grammar is not None)
            ):
                # Its last token is in flight, and another step would sample past it; or
                # its grammar has two tokens to take before it can mask a third.
                continue
            num_new = min(known - computed, budget)
            if num_new <= 0:
                continue
            end = computed + num_new
            block_ids = request.block_ids
            if end > len(block_ids) * block_size:  # else: the common decode
                num_blocks = -(-end // block_size) - len(block_ids)
                while not block_manager.can_allocate(num_blocks):
                    victim = running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    break  # it preempted itself: every younger request is gone already
                first_unsent = len(block_ids)
                block_ids.extend(block_manager.allocate(num_blocks))
                batch.add_blocks(request.seq_id, block_ids[first_unsent:])
            seq_id = request.seq_id
            add_seq_id(seq_id)
            add_computed(computed)
            add_scheduled(num_new)
            add_request(request)
            request.num_computed_tokens = end
            # The worker samples when the computed tokens reach the length it knows.
            if end == known:
                add_sampler(seq_id)
                request.num_pending_tokens = pending + 1
            if computed < num_prompt:
                prompt_part = min(end, num_prompt) - computed
                request.num_computed_prompt_tokens += prompt_part
                prompt_tokens_computed += prompt_part
            if unindexed is not None and end >= (len(request.prefix_nodes) + 1) * block_size:
                unindexed.append(request)  # as _completes_a_block, inlined
            budget -= num_new
        self.prompt_tokens_computed += prompt_tokens_computed
        return budget, preempted

    def _completes_a_block(self, request: Request) -> bool:
        """Whether the planned tokens fill a block past those the prefix cache indexed."""
        return request.num_computed_tokens >= (len(request.prefix_nodes) + 1) * self.block_size

    def _plan_new(
        self, batch: StepBuilder, request: Request, num_new: int, num_blocks: int
    ) -> None:
        """Add ``num_new`` tokens of a just admitted request to the step, with ``num_blocks``
        more blocks. Its update carries its whole table (prefix cache hits first)."""
        if num_blocks > 0:
            request.block_ids.extend(self.block_manager.allocate(num_blocks))
        if request.block_ids:
            batch.add_blocks(request.seq_id, request.block_ids[:])
        computed = request.num_computed_tokens
        # The worker samples when the computed tokens reach the length it knows.
        samples = computed + num_new == request.num_known_tokens
        batch.add_row(request, computed, num_new, samples)
        request.num_computed_tokens = computed + num_new
        if samples:
            request.num_pending_tokens += 1
        if computed < request.num_prompt_tokens:
            prompt_part = min(computed + num_new, request.num_prompt_tokens) - computed
            request.num_computed_prompt_tokens += prompt_part
            self.prompt_tokens_computed += prompt_part
