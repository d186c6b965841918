"""Stop conditions the scheduler can decide on token ids alone.

Stop strings need text, so the detokenizer handles those.
"""

from __future__ import annotations

from pegainfer.protocol import SamplingParams


def check_stop(
    sampling: SamplingParams,
    output_token_ids: list[int],
    num_prompt_tokens: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> tuple[str, int | None] | None:
    """Whether the newest token ends the request: ``(finish_reason, stop_reason)`` or None.

    Checked in order: stop_token_ids, EOS, max_tokens, max_model_len. The stop token ids and
    EOS only count once ``min_tokens`` tokens exist (the new one included). A matched stop
    token id is the stop reason; EOS has none, as in the OpenAI-compatible servers.
    """
    num_output = len(output_token_ids)
    if num_output == 0:
        return None
    last = output_token_ids[-1]
    if num_output >= sampling.min_tokens:
        if last in sampling.stop_token_ids:
            return "stop", last
        if not sampling.ignore_eos and last in eos_token_ids:
            return "stop", None
    if num_output >= sampling.max_tokens:
        return "length", None
    if num_prompt_tokens + num_output >= max_model_len:
        return "length", None
    return None


def stop_screen(
    sampling: SamplingParams,
    num_prompt_tokens: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> tuple[frozenset[int], int]:
    """A cheap screen in front of ``check_stop``, made once per request: ``(ids, length)``
    such that the newest token can only end the request if it is in ``ids`` or the output
    has ``length`` tokens or more. Every sampled token passes it, so it must stay exact: it
    may send a token to ``check_stop`` needlessly, never skip one that stops."""
    ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        ids |= eos_token_ids
    return frozenset(ids), min(sampling.max_tokens, max_model_len - num_prompt_tokens)
