"""Framing of the sandbox channels: round trips, partial reads, and hostile peers."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

import pytest

from services.sandbox.runtime.protocol import (
    MAX_DEPTH,
    FrameDecoder,
    FrameTooLarge,
    ProtocolError,
    encode_frame,
    recv_frame,
    send_frame,
)


def test_round_trip_byte_by_byte() -> None:
    messages: list[dict[str, Any]] = [
        {"op": "step", "action": "\\boxed{push 3}"},
        {"op": "outcome", "reward": 1.0, "ü": "✓"},
        {},
    ]
    data = b"".join(encode_frame(m) for m in messages)
    decoder = FrameDecoder()
    got = []
    for i in range(len(data)):
        got.extend(decoder.feed(data[i : i + 1]))
    assert got == messages
    assert decoder.pending == 0


def test_announced_size_over_the_limit_is_refused_before_buffering() -> None:
    decoder = FrameDecoder(max_frame=100)
    with pytest.raises(FrameTooLarge) as caught:
        decoder.feed(struct.pack(">I", 101))
    assert (caught.value.size, caught.value.limit) == (101, 100)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"{oops", "not UTF-8 JSON"),
        (b"[" * 200_000 + b"]" * 200_000, "RecursionError"),  # never a RecursionError of its own
        (b'{"a":' * 200_000 + b"1" + b"}" * 200_000, "RecursionError"),
        (b'{"a": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", f"deeper than {MAX_DEPTH}"),
        (b'{"observation": "\\ud800"}', "lone surrogate"),
        (b'{"k": ["ok", {"\\udfff": 1}]}', "lone surrogate"),
        (b'{"reward": NaN}', "NaN is not JSON"),
        (b'{"reward": -Infinity}', "Infinity is not JSON"),
        (b'{"reward": 1e999}', "overflows a float"),
        (b'{"turn": ' + b"9" * 5000 + b"}", "not UTF-8 JSON"),
    ],
)
def test_malformed_bodies_are_protocol_errors(body: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


def test_an_ordinary_frame_skips_the_shape_walk_and_a_refusable_one_never_does() -> None:
    from services.sandbox.runtime.protocol import _may_be_misshapen

    step = json.dumps({"op": "outcome", "outcome": {"observation": "x é " * 500, "reward": 0.5, "info": {}}})
    assert not _may_be_misshapen(step.encode())
    deep = b'{"a": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}"
    for body in (deep, b'{"observation": "\\ud800"}', b'{"k": ["ok", {"\\uDFFF": 1}]}'):
        assert _may_be_misshapen(body), body


def test_what_the_protocol_carries_still_decodes() -> None:
    nested: Any = "leaf"
    for _ in range(MAX_DEPTH - 1):
        nested = [nested]
    message = {"a": "\U0001f600 ✓", "b": 1.5e300, "c": -(2**62), "deep": nested}
    assert FrameDecoder().feed(encode_frame(message)) == [message]
    paired = b'{"s": "\\ud83d\\ude00"}'  # a surrogate pair, escaped: one character
    assert FrameDecoder().feed(struct.pack(">I", len(paired)) + paired) == [{"s": "\U0001f600"}]


def test_non_finite_numbers_are_not_encoded() -> None:
    with pytest.raises(ValueError):
        encode_frame({"reward": float("nan")})


def test_blocking_socket_helpers() -> None:
    left, right = socket.socketpair()
    with left, right:
        send_frame(left, {"op": "ping", "n": 1})
        assert recv_frame(right) == {"op": "ping", "n": 1}
        left.sendall(encode_frame({"op": "big", "x": "y" * 200}))
        with pytest.raises(FrameTooLarge):
            recv_frame(right, max_frame=64)


def test_end_of_stream_clean_and_inside_a_frame() -> None:
    left, right = socket.socketpair()
    with right:
        left.close()
        assert recv_frame(right) is None
    left, right = socket.socketpair()
    with right:
        left.sendall(encode_frame({"op": "cut"})[:-2])
        left.close()
        with pytest.raises(ProtocolError, match="closed"):
            recv_frame(right)
