"""A few throwaway requests through the runner's own step path, once, at start-up.

CUDA loads a kernel's module the first time the kernel launches (lazy loading). The decode
and prefill graphs' capture launches the model's kernels, but some of torch's eager ops run
only once requests arrive: the block-table write of a new sequence, the prefill graphs'
input copies, the sampler's own. Each first launch of such an op loads its module inside
a request's time to first token; on an H200 the first new sequence's block-table write alone
took 13.5 ms, and the first 1,024-token prompt 29-38 ms against 14-15 for the next.

The requests take the paths of a greedy request and of one that names no sampling field
(the server's defaults: temperature 1 with no filters, or the model's own settings from its
generation_config.json, such as Qwen3's top-k candidates), as a serving step does: a prefill
through a graph where one fits, two steps in flight so that the next step reads a token
still on the device, a decode step and a mixed step, in batches of at most
``max_num_seqs``. A loaded module stays resident in the worker's host memory, so the rarer
paths are left to their first request: with top-k, top-p and min-p, a seed, penalties and
prompt logprobs warmed too, the idle tree's PSS grew from 1,369 to 1,632 MB (Qwen3-4B shape,
H200), past its 1.5 GB target; the greedy and plain sampled paths cost 22 MB. The others'
first use cost about 25-50 ms each (top-p 44 ms, min-p 37, penalties 52, logprobs 27),
measured before the sampler drew every row by the race kernel: a seeded row without
filters now takes the warmed path, and the others' first uses were not measured again.

They use KV blocks from 0 up: at start-up the scheduler holds none, and a sequence writes
its blocks before it reads them. Every sequence is freed again, and the sampler's call count
(the unseeded rows' noise) starts over, so the runner starts serving as if nothing had run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pegainfer.protocol import (
    BlockTableUpdate,
    NewSequence,
    SamplingParams,
    StepPlan,
    pack_ids,
)
from worker_proc.sampler import is_greedy

if TYPE_CHECKING:
    from worker_proc.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Far above the scheduler's ids, which count up from 0; the sequences are gone before the
# scheduler's first plan either way.
FIRST_SEQ_ID = 1 << 30
PROMPT_TOKENS = 12

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PLAIN_SAMPLED = SamplingParams(max_tokens=4, temperature=1.0)


def warm_up_samplings(defaults: dict[str, Any]) -> tuple[SamplingParams, SamplingParams]:
    """A greedy request and one that names no sampling field: the server's defaults
    (``EngineConfig.sampling_defaults``, from the model's generation_config.json; Qwen3's
    take the top-k candidate path), or plain temperature 1 where those are greedy."""
    default = SamplingParams(max_tokens=4, **defaults)
    return GREEDY, PLAIN_SAMPLED if is_greedy(default) else default


class _Steps:
    """Plans for the runner, under negative step ids, which the scheduler never sends."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = -(1 << 30)
        self.next_seq = FIRST_SEQ_ID
        self.next_block = 0
        self.computed: dict[int, int] = {}

    def new(self, sampling: SamplingParams, prompt_len: int) -> tuple[NewSequence, list[int]]:
        seq_id, self.next_seq = self.next_seq, self.next_seq + 1
        vocab = self.runner.model_config.vocab_size
        prompt = [(7 * i + 1) % vocab for i in range(prompt_len)]
        blocks = self.runner.kv_spec.blocks_for_tokens(prompt_len + 2)
        table = list(range(self.next_block, self.next_block + blocks))
        self.next_block += blocks
        self.computed[seq_id] = 0
        return NewSequence(seq_id, pack_ids(prompt), sampling, prompt_len), table

    def submit(
        self,
        new: Sequence[tuple[NewSequence, list[int]]] = (),
        decode: Sequence[int] = (),
        finished: Sequence[int] = (),
    ) -> None:
        """One step: every new sequence's whole prompt, one token of each ``decode``."""
        seq_ids = [n.seq_id for n, _ in new] + list(decode)
        scheduled = [n.num_prompt_tokens for n, _ in new] + [1] * len(decode)
        computed = [self.computed[s] for s in seq_ids]
        for seq_id, count in zip(seq_ids, scheduled, strict=True):
            self.computed[seq_id] += count
        self.step_id += 1
        self.runner.submit(
            StepPlan(
                self.step_id,
                [n for n, _ in new],
                pack_ids(seq_ids),
                pack_ids(computed),
                pack_ids(scheduled),
                [BlockTableUpdate(n.seq_id, pack_ids(table)) for n, table in new],
                pack_ids(list(finished)),
            )
        )

    def blocks_needed(self, count: int, prompt_len: int) -> int:
        return count * self.runner.kv_spec.blocks_for_tokens(prompt_len + 2)


def warm_up_step_path(runner: ModelRunner) -> float:
    """Run the throwaway requests and wait for them; returns the seconds it took (0 when
    the KV cache is too small to hold them)."""
    started = time.monotonic()
    steps = _Steps(runner)
    samplings = warm_up_samplings(runner.config.sampling_defaults)
    prompt_len = max(1, min(PROMPT_TOKENS, runner.config.max_model_len - 3))
    max_num_seqs = max(1, runner.config.max_num_seqs)
    # A mixed step (a group decoding beside one more prompt) where the batch has room.
    group_size = max(1, min(max_num_seqs - 1, len(samplings)))
    mixed = group_size < max_num_seqs
    if steps.blocks_needed(group_size + int(mixed), prompt_len) > runner.num_kv_blocks:
        logger.info("start-up warm-up skipped: the KV cache has too few blocks")
        return 0.0
    with torch.inference_mode():
        for first in range(0, len(samplings), group_size):
            group = [steps.new(s, prompt_len) for s in samplings[first : first + group_size]]
            ids = [n.seq_id for n, _ in group]
            steps.submit(new=group)
            # Submitted before the prefill's tokens reach the host, as in serving: the
            # decode inputs come from the device, and the mixed step after it does too.
            steps.submit(decode=ids)
            finished = list(ids)
            if mixed:
                extra = steps.new(GREEDY, prompt_len)
                steps.submit(new=[extra], decode=ids)
                finished.append(extra[0].seq_id)
            runner.poll_results(wait=True)
            steps.submit(finished=finished)
            runner.poll_results(wait=True)
            steps.next_block = 0
    runner.sampler.reseed()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.monotonic() - started
