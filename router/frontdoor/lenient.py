"""Turn requests protobuf cannot (or should not) parse into clear INVALID_ARGUMENT messages.

gRPC's default deserializer answers a message with invalid UTF-8 in a string field with a bare
INTERNAL error, and one over the transport limit with RESOURCE_EXHAUSTED. The router's handlers
deserialize leniently instead: an oversized or unparsable request becomes an `Unparsable` value
whose message names the offending field (found by walking the wire format) and the limit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

MAX_REQUEST_BYTES = 16 * 1024 * 1024  # the application limit on one request message
TRANSPORT_LIMIT_BYTES = 64 * 1024 * 1024  # gRPC's own limit, above it (so ours is the one hit)


@dataclass(frozen=True)
class Unparsable:
    reason: str


def lenient(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer that returns `Unparsable` instead of failing the RPC."""

    def parse(data: bytes) -> Any:
        if len(data) > MAX_REQUEST_BYTES:
            return Unparsable(f"request is {len(data)} bytes; the limit is {MAX_REQUEST_BYTES} "
                              f"bytes ({MAX_REQUEST_BYTES // (1024 * 1024)} MiB)")
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            field = find_bad_utf8(data, message_type.DESCRIPTOR)
            if field is not None:
                return Unparsable(f"{field} is not valid UTF-8")
            return Unparsable(f"request is not a valid {message_type.DESCRIPTOR.name}: {exc}")

    return parse


def find_bad_utf8(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """The dotted path (with [index] for repeated fields) of the first string field holding
    invalid UTF-8, or None."""
    try:
        return _walk(data, descriptor, prefix)
    except IndexError:  # truncated message: nothing more to say than protobuf's error
        return None


def _walk(data: bytes, descriptor: Descriptor, prefix: str) -> str | None:
    pos, seen = 0, {}
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            size, pos = _varint(data, pos)
            chunk, pos = data[pos:pos + size], pos + size
            found = _check_field(chunk, descriptor.fields_by_number.get(number), prefix, seen)
            if found is not None:
                return found
        else:
            return None  # groups are not used by this contract
    return None


def _check_field(chunk: bytes, field: FieldDescriptor | None, prefix: str,
                 seen: dict[int, int]) -> str | None:
    if field is None:
        return None
    name = prefix + field.name
    if field.is_repeated:
        index = seen.get(field.number, 0)
        seen[field.number] = index + 1
        name += f"[{index}]"
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return name
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        return _walk(chunk, field.message_type, name + ".")
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
