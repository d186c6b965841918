"""The step plan being assembled, column by column, and its encoding as a ``StepPlan``."""

from __future__ import annotations

from pegainfer.protocol import BlockTableUpdate, NewSequence, StepPlan, pack_ids
from scheduler_proc.request import Request


class StepBuilder:
    __slots__ = (
        "seq_ids",
        "num_computed",
        "num_scheduled",
        "samplers",
        "block_updates",
        "new_seqs",
        "requests",
    )

    def __init__(self) -> None:
        self.seq_ids: list[int] = []
        self.num_computed: list[int] = []
        self.num_scheduled: list[int] = []
        self.samplers: list[int] = []  # seq ids that sample a token in this step
        self.block_updates: list[BlockTableUpdate] = []
        self.new_seqs: list[NewSequence] = []
        self.requests: list[Request] = []  # the planned requests, in batch order

    def add_new_sequence(self, request: Request) -> None:
        """Send the request's tokens and sampling settings: the workers have not seen it."""
        self.new_seqs.append(
            NewSequence(
                seq_id=request.seq_id,
                token_ids=request.packed_tokens(0, request.num_tokens),
                sampling=request.sampling,
                num_prompt_tokens=request.num_prompt_tokens,
            )
        )

    def add_blocks(self, seq_id: int, block_ids: list[int]) -> None:
        self.block_updates.append(BlockTableUpdate(seq_id, pack_ids(block_ids)))

    def add_row(self, request: Request, num_computed: int, num_new: int, samples: bool) -> None:
        self.seq_ids.append(request.seq_id)
        self.num_computed.append(num_computed)
        self.num_scheduled.append(num_new)
        self.requests.append(request)
        if samples:
            self.samplers.append(request.seq_id)

    def build(self, step_id: int, finished_seq_ids: list[int]) -> StepPlan:
        return StepPlan(
            step_id=step_id,
            new_seqs=self.new_seqs,
            seq_ids=pack_ids(self.seq_ids),
            num_computed=pack_ids(self.num_computed),
            num_scheduled=pack_ids(self.num_scheduled),
            block_updates=self.block_updates,
            finished_seq_ids=pack_ids(finished_seq_ids),
        )
