"""RESP2, as much of it as the token relay speaks (gateway/relay.py): commands out, replies and
pub/sub pushes in. Parsing works on a buffer that may hold many replies or part of one, so one
socket read can yield many frames."""

from __future__ import annotations

import asyncio


class RespError(str):
    """An error reply (-ERR ...)."""


def pack(parts: tuple[bytes, ...]) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def parse(buf: bytearray, pos: int) -> tuple[object, int] | None:
    """One RESP2 value from `buf` at `pos`: (value, next position), or None if incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind = buf[pos]
    line = bytes(buf[pos + 1:end])
    nxt = end + 2
    if kind == 36:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, nxt
        if len(buf) < nxt + n + 2:
            return None
        return bytes(buf[nxt:nxt + n]), nxt + n + 2
    if kind == 42:  # * array
        n = int(line)
        items = []
        for _ in range(max(n, 0)):
            parsed = parse(buf, nxt)
            if parsed is None:
                return None
            value, nxt = parsed
            items.append(value)
        return items, nxt
    if kind == 58:  # : integer
        return int(line), nxt
    if kind == 43:  # + simple string
        return line, nxt
    if kind == 45:  # - error
        return RespError(line.decode(errors="replace")), nxt
    raise ConnectionError(f"unexpected RESP type byte {kind!r}")


async def read_one(reader: asyncio.StreamReader, buf: bytearray) -> object:
    while True:
        parsed = parse(buf, 0)
        if parsed is not None:
            item, pos = parsed
            del buf[:pos]
            return item
        data = await asyncio.wait_for(reader.read(1 << 16), timeout=5.0)
        if not data:
            raise ConnectionError("Redis closed the connection during the handshake")
        buf += data
