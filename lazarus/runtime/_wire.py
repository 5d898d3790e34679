"""Wire format shared by the controller, the agents and the worker channel.

One frame is::

    +-------------------+---------------------------+---------------------------+
    | L: 4 bytes, BE u32 | HMAC-SHA256(secret, body) | body: UTF-8 JSON object   |
    |                    | (32 bytes)                | with a string "type"      |
    +-------------------+---------------------------+---------------------------+

``L`` counts the MAC and the body. The announced length is checked against the
receiver's limit *before* the body is read, so a peer cannot make us buffer more than
``max_bytes``. The MAC is checked (constant time) before the JSON is parsed. Nothing is
ever unpickled.

A body of more than :data:`COMPRESS_OVER` bytes (a plan: 118 KB at 1,024 nodes, sent to
every node) goes zlib-compressed: the top bit of ``L`` says so (lengths stay under 2**31),
the MAC covers the compressed bytes (checked before anything is inflated), and inflating
stops at the receiver's ``max_bytes`` (a small frame cannot expand into a large one past
the limit). A plan's JSON repeats its keys and node names: it shrinks ~10x, so a failure's
new plan reaches a thousand nodes in a tenth of the bytes.

One frame is the exception: the controller's answer to a first frame whose MAC does not
match (:data:`AUTH_FAILED_FRAME`), which cannot be authenticated since the two sides do
not share a secret. It is one fixed byte string (an all-zero MAC, body
``{"type":"auth_failed"}``): the agent recognises it by comparing the whole frame, so
that it can say "the secret does not match" instead of "connection closed". What a peer
without the secret learns from it is what a closed connection tells it already (its MAC
was wrong, this is a Lazarus controller): the bytes are the same whatever the secret and
whatever was sent, so they carry nothing about the secret (the MAC comparison before it
is constant-time); they are 58 bytes, on TCP, whose handshake rules out answering a
forged source address (nothing to amplify). A forged one can only make an
agent that is registering give up, which whoever can answer in the controller's place
can do anyway by refusing the connection; an agent already registered once does not give
up on it (it keeps reconnecting, see the agent).

Both asyncio helpers (controller, agent) and blocking-socket helpers (the worker-side
channel, which lives in a training process that has no event loop) are provided.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import struct
import zlib
from typing import Any

__all__ = [
    "AUTH_FAILED_FRAME",
    "COMPRESS_OVER",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAC_BYTES",
    "PLAN_MAX_MESSAGE_BYTES",
    "AuthRefusedError",
    "BadMacError",
    "ConnectionClosed",
    "FrameTooLargeError",
    "MalformedMessageError",
    "ProtocolError",
    "decode_payload",
    "encode_frame",
    "read_frame",
    "store_address",
    "recv_frame",
    "send_frame",
    "write_frame",
]

_HEADER = struct.Struct(">I")
MAC_BYTES = 32
#: Default limit on a frame's body (the JSON text), in bytes.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
#: Limit for frames coming *down* from the controller (plans of large clusters can exceed
#: 1 MiB; they are authenticated before being parsed, and only the controller sends them).
PLAN_MAX_MESSAGE_BYTES = 1 << 28
#: Bodies longer than this go zlib-compressed (see the module docstring).
COMPRESS_OVER = 16 << 10
_ZLIB = 1 << 31           # the length word's top bit: the body is zlib-compressed
_ZLIB_LEVEL = 1           # the fastest: a plan's JSON compresses ~10x at level 1 already


class ProtocolError(ValueError):
    """A frame that breaks the protocol; the connection it came on must be closed."""


class BadMacError(ProtocolError):
    """The frame's HMAC does not match its body (wrong secret or tampering)."""


class AuthRefusedError(ProtocolError):
    """The peer answered with :data:`AUTH_FAILED_FRAME`: our MAC did not match its secret."""


class FrameTooLargeError(ProtocolError):
    """The announced frame length exceeds the receiver's ``max_message_bytes``."""


class MalformedMessageError(ProtocolError):
    """Authenticated but unusable: not UTF-8 JSON, not an object, or no string "type"."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (``mid_frame``: inside a frame, i.e. abruptly)."""

    def __init__(self, message: str = "connection closed", *, mid_frame: bool = False) -> None:
        super().__init__(message)
        self.mid_frame = mid_frame


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


_AUTH_FAILED_BODY = b'{"type":"auth_failed"}'
#: The controller's refusal of a first frame with a wrong MAC (see the module docstring):
#: fixed bytes, not authenticated (an all-zero MAC), the same for every peer and secret.
AUTH_FAILED_FRAME = _HEADER.pack(MAC_BYTES + len(_AUTH_FAILED_BODY)) + bytes(MAC_BYTES) + _AUTH_FAILED_BODY
_AUTH_FAILED_PAYLOAD = AUTH_FAILED_FRAME[_HEADER.size:]


def encode_frame(secret: bytes, msg: dict[str, Any]) -> bytes:
    """Serialise ``msg`` into one complete frame (header, MAC, body; a body of more than
    :data:`COMPRESS_OVER` bytes compressed)."""
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise MalformedMessageError("a message must be a dict with a string 'type'")
    body = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    flag = 0
    if len(body) > COMPRESS_OVER:
        body, flag = zlib.compress(body, _ZLIB_LEVEL), _ZLIB
    return _HEADER.pack(flag | (MAC_BYTES + len(body))) + _mac(secret, body) + body


def _split_length(word: int) -> tuple[int, bool]:
    """The length word as (bytes that follow, compressed)."""
    return word & ~_ZLIB, bool(word & _ZLIB)


def _inflate(body: bytes, max_bytes: int) -> bytes:
    """A compressed body, inflated to at most ``max_bytes``."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise MalformedMessageError(f"compressed body does not inflate: {exc}") from None
    if len(out) > max_bytes or d.unconsumed_tail:
        raise FrameTooLargeError(f"compressed body inflates past the limit of {max_bytes} bytes")
    if not d.eof:
        raise MalformedMessageError("compressed body is truncated")
    return out


def _check_length(length: int, max_bytes: int) -> None:
    if length > MAC_BYTES + max_bytes:
        raise FrameTooLargeError(
            f"frame announces {length} bytes, more than the limit of {max_bytes} + {MAC_BYTES}"
        )
    if length < MAC_BYTES + 2:  # the smallest JSON object is "{}"
        raise MalformedMessageError(f"frame of {length} bytes is too short for a MAC and a body")


def decode_payload(secret: bytes, payload: bytes, *, compressed: bool = False,
                   max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Check the MAC of ``payload`` (MAC + body) and parse the body into a message
    (``compressed``: inflated first, to at most ``max_bytes``, after the MAC check)."""
    mac, body = payload[:MAC_BYTES], payload[MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, body)):
        if payload == _AUTH_FAILED_PAYLOAD and not compressed:
            raise AuthRefusedError("the peer refused our HMAC: its shared secret is not ours")
        raise BadMacError("HMAC mismatch (wrong secret?)")
    if compressed:
        body = _inflate(body, max_bytes)
    try:
        msg = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedMessageError(f"body is not UTF-8 JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise MalformedMessageError(f"body must be a JSON object, got {type(msg).__name__}")
    if not isinstance(msg.get("type"), str):
        raise MalformedMessageError("message has no string field 'type'")
    return msg


# ----------------------------------------------------------------------------- asyncio


async def read_frame(
    reader: asyncio.StreamReader, secret: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> dict[str, Any]:
    """Read one frame. Raises :class:`ProtocolError` subclasses or :class:`ConnectionClosed`."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        raise ConnectionClosed("connection closed", mid_frame=bool(exc.partial)) from None
    except ConnectionError as exc:  # reset by peer
        raise ConnectionClosed(f"connection lost: {exc}", mid_frame=False) from None
    length, compressed = _split_length(_HEADER.unpack(header)[0])
    _check_length(length, max_bytes)
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ConnectionClosed("connection closed inside a frame", mid_frame=True) from None
    except ConnectionError as exc:
        raise ConnectionClosed(f"connection lost inside a frame: {exc}", mid_frame=True) from None
    return decode_payload(secret, payload, compressed=compressed, max_bytes=max_bytes)


async def write_frame(writer: asyncio.StreamWriter, secret: bytes, msg: dict[str, Any]) -> None:
    """Write one frame and wait for the transport buffer to drain.

    The frame goes out in a single ``write`` call, so concurrent writers never interleave.
    """
    writer.write(encode_frame(secret, msg))
    await writer.drain()


# ----------------------------------------------------------------------------- blocking


def _recv_exactly(sock: socket.socket, n: int, started: bool) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except ConnectionError as exc:
            raise ConnectionClosed(f"connection lost: {exc}", mid_frame=started or bool(buf)) from None
        if not chunk:
            raise ConnectionClosed("connection closed", mid_frame=started or bool(buf))
        buf += chunk
    return bytes(buf)


def recv_frame(
    sock: socket.socket, secret: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> dict[str, Any]:
    """Blocking :func:`read_frame` for a plain socket."""
    length, compressed = _split_length(_HEADER.unpack(_recv_exactly(sock, _HEADER.size, False))[0])
    _check_length(length, max_bytes)
    return decode_payload(secret, _recv_exactly(sock, length, True), compressed=compressed, max_bytes=max_bytes)


def send_frame(sock: socket.socket, secret: bytes, msg: dict[str, Any]) -> None:
    """Blocking :func:`write_frame` (callers serialise concurrent senders)."""
    sock.sendall(encode_frame(secret, msg))


def store_address(value: Any) -> dict[str, Any] | None:
    """``{"host": str, "port": int}`` of a rendezvous store a worker hosts, from a message
    field; None when the field is absent. Raises :class:`MalformedMessageError` when it is
    there but not such an address."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("host"), str) or not value["host"] \
            or isinstance(value.get("port"), bool) or not isinstance(value.get("port"), int) \
            or not 1 <= value["port"] <= 65535:
        raise MalformedMessageError(f"field 'store' must be {{'host': address, 'port': 1-65535}}, got {value!r}")
    return {"host": value["host"], "port": int(value["port"])}
