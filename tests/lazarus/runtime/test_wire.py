"""The control plane's wire format: HMAC-authenticated, length-prefixed JSON frames."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import struct
import zlib
from datetime import timedelta

import pytest

from lazarus.runtime import AgentConfig, ControllerConfig, parse_duration
from lazarus.runtime._wire import (
    COMPRESS_OVER,
    MAC_BYTES,
    BadMacError,
    ConnectionClosed,
    FrameTooLargeError,
    MalformedMessageError,
    ProtocolError,
    decode_payload,
    encode_frame,
    read_frame,
    recv_frame,
    send_frame,
    write_frame,
)

pytestmark = pytest.mark.timeout(30)

SECRET = b"wire-test-secret-0123456789"


def raw_frame(body: bytes, secret: bytes = SECRET, length: int | None = None) -> bytes:
    mac = hmac.new(secret, body, hashlib.sha256).digest()
    n = len(mac) + len(body) if length is None else length
    return struct.pack(">I", n) + mac + body


def read_async(data: bytes, max_bytes: int = 1 << 20, eof: bool = True) -> dict:
    async def go() -> dict:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await read_frame(reader, SECRET, max_bytes)

    return asyncio.run(go())


def test_round_trip_blocking_and_async() -> None:
    msg = {"type": "plan", "generation": 3, "layers": {"l0": [[0, 1], [2, 3]]}, "name": "nœud-α"}
    frame = encode_frame(SECRET, msg)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert read_async(frame) == msg

    a, b = socket.socketpair()
    with a, b:
        send_frame(a, SECRET, msg)
        send_frame(a, SECRET, {"type": "x"})
        assert recv_frame(b, SECRET) == msg
        assert recv_frame(b, SECRET) == {"type": "x"}

    async def via_streams() -> dict:
        got: list[dict] = []

        async def serve(reader, writer):
            got.append(await read_frame(reader, SECRET))
            await write_frame(writer, SECRET, {"type": "ack"})
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await write_frame(writer, SECRET, msg)
        ack = await read_frame(reader, SECRET)
        writer.close()
        server.close()
        await server.wait_closed()
        assert ack == {"type": "ack"}
        return got[0]

    assert asyncio.run(via_streams()) == msg


def test_bad_hmac_is_rejected() -> None:
    frame = encode_frame(b"another-secret-0123456789", {"type": "register"})
    with pytest.raises(BadMacError):
        read_async(frame)
    tampered = bytearray(encode_frame(SECRET, {"type": "register", "node": "a"}))
    tampered[-3] ^= 0x01
    with pytest.raises(BadMacError):
        read_async(bytes(tampered))
    assert issubclass(BadMacError, ProtocolError) and issubclass(ProtocolError, ValueError)


def test_oversized_length_rejected_before_reading_body() -> None:
    header_only = struct.pack(">I", MAC_BYTES + 1001)
    # no body and no EOF fed: the reader would block if it tried to read the body
    with pytest.raises(FrameTooLargeError):
        read_async(header_only, max_bytes=1000, eof=False)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(header_only)
        with pytest.raises(FrameTooLargeError):
            recv_frame(b, SECRET, 1000)
    # exactly at the limit is fine
    body = b'{"type":"x","pad":"' + b"a" * 200 + b'"}'
    assert read_async(raw_frame(body), max_bytes=len(body))["type"] == "x"
    with pytest.raises(FrameTooLargeError):
        read_async(raw_frame(body), max_bytes=len(body) - 1)


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[1, 2]", b'"register"', b"42"])
def test_malformed_json_rejected(body: bytes) -> None:
    with pytest.raises(MalformedMessageError):
        read_async(raw_frame(body))


@pytest.mark.parametrize("body", [b'{"node": "a"}', b'{"type": 7}', b'{"type": null}'])
def test_missing_or_bad_type_rejected(body: bytes) -> None:
    with pytest.raises(MalformedMessageError, match="type"):
        read_async(raw_frame(body))
    with pytest.raises(MalformedMessageError):
        decode_payload(SECRET, raw_frame(body)[4:])


def test_too_short_frame_is_malformed() -> None:
    with pytest.raises(MalformedMessageError):
        read_async(struct.pack(">I", 5) + b"12345")


def test_eof_at_boundary_and_mid_frame() -> None:
    with pytest.raises(ConnectionClosed) as info:
        read_async(b"")
    assert not info.value.mid_frame
    frame = encode_frame(SECRET, {"type": "heartbeat"})
    with pytest.raises(ConnectionClosed) as info:
        read_async(frame[:-4])
    assert info.value.mid_frame
    with pytest.raises(ConnectionClosed) as info:
        read_async(frame[:2])
    assert info.value.mid_frame
    a, b = socket.socketpair()
    with b:
        a.sendall(frame[:10])
        a.close()
        with pytest.raises(ConnectionClosed) as info:
            recv_frame(b, SECRET)
        assert info.value.mid_frame


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(MalformedMessageError):
        encode_frame(SECRET, {"no": "type"})
    with pytest.raises(MalformedMessageError):
        encode_frame(SECRET, ["type"])  # type: ignore[arg-type]


def test_config_validation_names_fields() -> None:
    with pytest.raises(ValueError, match="secret must be at least 16 bytes"):
        ControllerConfig(secret=b"short")
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        ControllerConfig(secret=SECRET, heartbeat_timeout=timedelta(0))
    with pytest.raises(ValueError, match="heartbeat_timeout must be a datetime.timedelta"):
        ControllerConfig(secret=SECRET, heartbeat_timeout=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"slots_per_node must be an integer >= 1"):
        ControllerConfig(secret=SECRET, slots_per_node=0)
    with pytest.raises(ValueError, match=r"port must be an integer \[0, 65535\]"):
        ControllerConfig(secret=SECRET, port=70000)
    with pytest.raises(ValueError, match="rebalance_min_gain"):
        ControllerConfig(secret=SECRET, rebalance_min_gain=2.0)
    with pytest.raises(ValueError, match="worker_command"):
        AgentConfig(secret=SECRET, worker_command=[])
    with pytest.raises(ValueError, match="node_id"):
        AgentConfig(secret=SECRET, worker_command=["true"], node_id="bad id/with slash")
    with pytest.raises(ValueError, match=r"max_restarts must be an integer >= 0"):
        AgentConfig(secret=SECRET, worker_command=["true"], max_restarts=-1)
    with pytest.raises(ValueError, match="restart_window"):
        AgentConfig(secret=SECRET, worker_command=["true"], restart_window=timedelta(0))
    with pytest.raises(ValueError, match="reconnect_timeout must be a datetime.timedelta"):
        AgentConfig(secret=SECRET, worker_command=["true"], reconnect_timeout=30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exit_grace"):
        ControllerConfig(secret=SECRET, exit_grace=timedelta(seconds=-1))
    cfg = AgentConfig(secret=SECRET, worker_command=["true"], node_id="n1", job="j")
    assert cfg.snapshot_dir.endswith("lazarus-j/n1")
    assert parse_duration("500ms") == timedelta(milliseconds=500)
    assert parse_duration("3s") == timedelta(seconds=3)
    assert parse_duration("2m") == timedelta(minutes=2)
    with pytest.raises(ValueError, match="--join-window"):
        parse_duration("soon", "--join-window")


def _plan(nodes: int) -> dict:
    return {"type": "plan", "generation": 7, "members": [f"node-{i:04d}" for i in range(nodes)],
            "placement": {f"layer{l}": [[(i + j) % 64 for j in range(2)] for i in range(nodes)] for l in range(8)}}


def compressed_frame(body: bytes, secret: bytes = SECRET) -> bytes:
    mac = hmac.new(secret, body, hashlib.sha256).digest()
    return struct.pack(">I", (1 << 31) | (len(mac) + len(body))) + mac + body


def test_a_large_body_goes_compressed_and_round_trips() -> None:
    """A plan of a thousand nodes: zlib on the wire (the length word's top bit), a tenth of
    its JSON or less, the same message back on both readers; small messages stay plain."""
    msg = _plan(1024)
    plain = len(json.dumps(msg, separators=(",", ":")).encode())
    frame = encode_frame(SECRET, msg)
    (word,) = struct.unpack(">I", frame[:4])
    assert plain > COMPRESS_OVER and word >> 31 == 1 and (word & ~(1 << 31)) == len(frame) - 4
    assert len(frame) < plain / 8, (len(frame), plain)
    assert read_async(frame, max_bytes=1 << 24) == msg
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, SECRET, msg)
        assert recv_frame(b, SECRET, 1 << 24) == msg
    small = encode_frame(SECRET, {"type": "heartbeat", "node": "n0"})
    assert struct.unpack(">I", small[:4])[0] >> 31 == 0


def test_a_compressed_body_is_authenticated_before_it_is_inflated_and_inflates_only_to_the_limit() -> None:
    # a zip bomb with a good MAC: 64 MiB of zeros in ~64 KB, against a 1 MiB limit
    bomb = zlib.compress(b"0" * (64 << 20), 9)
    with pytest.raises(FrameTooLargeError, match="inflates past the limit of 1048576"):
        read_async(compressed_frame(bomb))
    # tampered: refused by the MAC, nothing inflated
    body = bytearray(zlib.compress(json.dumps(_plan(64)).encode()))
    body[len(body) // 2] ^= 0xFF
    frame = compressed_frame(b"x")[:4] + hmac.new(SECRET, b"other", hashlib.sha256).digest() + bytes(body)
    frame = struct.pack(">I", (1 << 31) | (MAC_BYTES + len(body))) + frame[4:]
    with pytest.raises(BadMacError):
        read_async(frame)
    # authenticated but not zlib, or cut short
    with pytest.raises(MalformedMessageError, match="does not inflate"):
        read_async(compressed_frame(b"not zlib at all"))
    whole = zlib.compress(json.dumps(_plan(64)).encode())
    with pytest.raises(MalformedMessageError, match="truncated"):
        read_async(compressed_frame(whole[: len(whole) // 2]))
