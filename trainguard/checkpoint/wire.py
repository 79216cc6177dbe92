"""How node agents (and a machine's ranks) talk about snapshots: one request per connection.

A message is one line of JSON (the header, at most :data:`MAX_HEADER` bytes), then, when the
header says ``"nbytes"`` and ``"body": true``, exactly that many raw bytes. Between agents every
header is signed with the project's key (:func:`trainguard.signing.sign_object`); the header of
a snapshot carries its SHA-256, so the signature covers the bytes too. Nothing received is
unpickled: headers are JSON, bodies raw tensor bytes (:mod:`trainguard.checkpoint.layout`).
"""
from __future__ import annotations

import hashlib
import json
import socket
from typing import BinaryIO, Optional

__all__ = ["MAX_HEADER", "CHUNK", "WireError", "read_header", "write_message", "copy_body",
           "connect", "request"]

MAX_HEADER = 1 << 20
CHUNK = 1 << 22


class WireError(ValueError):
    """A message that is not one: the peer is refused with this reason."""


def read_header(stream: BinaryIO) -> dict:
    line = stream.readline(MAX_HEADER + 1)
    if not line:
        raise WireError("connection closed before a header")
    if len(line) > MAX_HEADER or not line.endswith(b"\n"):
        raise WireError(f"header longer than {MAX_HEADER} bytes")
    try:
        obj = json.loads(line)
    except ValueError:
        raise WireError("header is not JSON") from None
    if not isinstance(obj, dict):
        raise WireError("header is not a JSON object")
    return obj


def write_message(stream: BinaryIO, header: dict, body=None) -> None:
    stream.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
    if body is not None:
        view = memoryview(body)
        for at in range(0, len(view), CHUNK):
            stream.write(view[at:at + CHUNK])
    stream.flush()


def copy_body(stream: BinaryIO, nbytes: int, out: BinaryIO) -> str:
    """Copy exactly ``nbytes`` from ``stream`` to ``out``; returns their SHA-256 (hex)."""
    h = hashlib.sha256()
    left = nbytes
    while left:
        chunk = stream.read(min(CHUNK, left))
        if not chunk:
            raise WireError(f"connection closed with {left} of {nbytes} bytes unsent")
        h.update(chunk)
        out.write(chunk)
        left -= len(chunk)
    return h.hexdigest()


def connect(address: str, timeout: float,
            connect_timeout: Optional[float] = None) -> socket.socket:
    """``host:port`` (TCP) or a path (a Unix socket). ``connect_timeout`` (default
    ``timeout``) bounds the connection alone: a machine that is gone answers nothing, and a
    restore must not wait for it as long as for a live peer's transfer."""
    if ":" in address and not address.startswith("/"):
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)),
                                        timeout=connect_timeout or timeout)
        sock.settimeout(timeout)
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(address)
    return sock


def request(address: str, header: dict, body=None, *, timeout: float = 10.0,
            out: Optional[BinaryIO] = None, connect_timeout: Optional[float] = None) -> tuple:
    """Send one request; ``(reply header, sha256 of the reply's body or None)``, the body
    copied to ``out`` when there is one."""
    with connect(address, timeout, connect_timeout) as sock, \
            sock.makefile("rwb") as stream:
        write_message(stream, header, body)
        reply = read_header(stream)
        sha = None
        if reply.get("body") and out is not None:
            nbytes = reply.get("nbytes")
            if not (isinstance(nbytes, int) and 0 <= nbytes):
                raise WireError(f"reply nbytes {nbytes!r} is not a size")
            sha = copy_body(stream, nbytes, out)
        return reply, sha
