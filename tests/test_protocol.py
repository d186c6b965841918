"""The wire format: round trips, and malformed input that never escapes as anything but
ProtocolError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegainfer import protocol as p


def _plan() -> p.StepPlan:
    return p.StepPlan(
        step_id=7,
        new_seqs=[
            p.NewSequence(
                seq_id=3,
                token_ids=p.pack_ids([1, 2, 151643]),
                sampling=p.SamplingParams(temperature=0.0, seed=11, stop=["\n\n"]),
                num_prompt_tokens=3,
            )
        ],
        seq_ids=p.pack_ids([3, 4]),
        num_computed=p.pack_ids([0, 17]),
        num_scheduled=p.pack_ids([3, 1]),
        block_updates=[p.BlockTableUpdate(seq_id=3, block_ids=p.pack_ids([9]))],
        finished_seq_ids=p.pack_ids([1]),
    )


def test_round_trip_of_every_message_kind():
    messages = [
        p.ProcessReady(name="worker-0", pid=12, info={"num_kv_blocks": 100}),
        p.GenerateRequest(
            request_id="cmpl-1",
            prompt=None,
            prompt_token_ids=None,
            messages=[{"role": "user", "content": "hi"}],
            chat_template_kwargs={"enable_thinking": False},
            add_generation_prompt=True,
            sampling=p.SamplingParams(max_tokens=-1),
            arrival_time=1.5,
        ),
        p.TokenizedRequest("cmpl-1", p.pack_ids([1, 2]), p.SamplingParams(), 2.0),
        p.RequestRejected("cmpl-1", 400, "too long", "invalid_request_error", None, "x"),
        p.AbortRequests(["a", "b"]),
        _plan(),
        p.StepResult(step_id=7, seq_ids=p.pack_ids([3]), token_ids=p.pack_ids([42])),
        p.TokenOutputs([p.SeqOutput("r", p.pack_ids([5]), "stop", 5, 3, 1, 0)]),
        p.TextOutputs([p.TextDelta("r", "héllo 🙂", p.pack_ids([5]), None, None, 3, 1, 0)]),
        p.Shutdown("bye"),
    ]
    for msg in messages:
        assert p.decode(p.encode(msg)) == msg


def test_packed_ids_round_trip_and_are_int32():
    ids = [0, 1, 2**31 - 1, 151935]
    packed = p.pack_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert p.unpack_ids(packed) == ids
    with pytest.raises(p.ProtocolError):
        p.unpack_ids(b"\x00\x01\x02")


def test_expected_types_restrict_a_socket():
    data = p.encode(p.AbortRequests(["a"]))
    with pytest.raises(p.ProtocolError):
        p.decode(data, expected=(p.StepResult,))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"a": 1}),
        msgpack.packb([]),
        msgpack.packb(["5", ["a"]]),
        msgpack.packb([999, 1]),
        msgpack.packb([5, "not a list"]),
        msgpack.packb([5]),
        msgpack.packb([7, "x", b"", b""]),  # StepResult with a str step id
        msgpack.packb([7, True, b"", b"", None]),  # bool is not an int here
        msgpack.packb([6, 1, [[1, b"", [1] * 3, 1]], b"", b"", b"", [], b""]),
    ],
)
def test_malformed_messages_raise_protocol_error(raw):
    with pytest.raises(p.ProtocolError):
        p.decode(raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_else(data):
    try:
        p.decode(data)
    except p.ProtocolError:
        pass


_wire_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=12), st.lists(_wire_values, max_size=9))
def test_random_structures_with_a_real_tag_never_raise_anything_else(tag, fields):
    try:
        p.decode(msgpack.packb([tag, *fields], use_bin_type=True))
    except p.ProtocolError:
        pass
