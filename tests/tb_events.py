"""Read TensorBoard event files back without the writer's code: the TFRecord framing parsed here
(length, its masked CRC-32C, the record, its CRC — checked), each record an ``Event`` protocol
buffer (the format's own message definition, from tensorboardX's generated ``event_pb2``)."""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = _crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def records(path: Path) -> list[bytes]:
    raw, out, i = path.read_bytes(), [], 0
    while i < len(raw):
        header = raw[i:i + 8]
        (n,), (hcrc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[i + 8:i + 12])
        assert _masked(header) == hcrc, f"{path}: bad length CRC at byte {i}"
        body = raw[i + 12:i + 12 + n]
        (bcrc,) = struct.unpack("<I", raw[i + 12 + n:i + 16 + n])
        assert _masked(body) == bcrc, f"{path}: bad record CRC at byte {i}"
        out.append(body)
        i += 16 + n
    return out


def read(directory: Path) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, str]]]:
    """Every scalar and text summary under ``directory``: ``{tag: {step: value}}``."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = defaultdict(dict)
    texts: dict[str, dict[int, str]] = defaultdict(dict)
    files = sorted(directory.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {directory}"
    for f in files:
        for rec in records(f):
            ev = event_pb2.Event.FromString(rec)
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    scalars[v.tag][ev.step] = v.simple_value
                elif v.HasField("tensor") and v.tensor.string_val:
                    texts[v.tag.removesuffix("/text_summary")][ev.step] = \
                        v.tensor.string_val[0].decode()
    return dict(scalars), dict(texts)
