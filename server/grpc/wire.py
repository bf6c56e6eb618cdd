"""A big request taken apart off the event loop, as far as the protobuf wire format allows.

grpc.aio parses a request on the event loop, in one call that holds the interpreter for
as long as the message takes (a million tiny entries: 0.2-0.9 s on 2 busy cores), so health checks
and every other call wait. A big payload is instead walked once at the top level, in
Python (which lets the interpreter go every few milliseconds): the walk counts each
field's entries, so a request with more entries than any request may carry is refused
before it is parsed, and finds field boundaries, where the payload is cut into slices that
are parsed one at a time (parsing the concatenation of slices is parsing the whole, by
protobuf's merge rule). A slice is never shorter than one top-level field, so a single
nested message (one sequence of ids, the attention options) is bounded on its own.
"""

import itertools

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

# Parsed on the event loop as it is: the densest payload (millions of empty entries)
# parses at ~36 ns a byte on 2 busy cores, so this holds the loop under 10 ms.
INLINE_BYTES = 256 << 10
# Each slice parses in ~2 ms at that rate.
SLICE_BYTES = 64 << 10
# One nested message (a field that is not a string or bytes) may take this much: it is
# parsed in one piece, ~70 ms at that rate. Its entries (ids, heads) are packed, so this
# is far more than any request that could be served needs (a 512-token sequence of ids
# is at most 1.5 KiB).
MAX_NESTED_BYTES = 2 << 20
# Wire types: varint, 64-bit, length-delimited, 32-bit.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class TooManyEntries(ValueError):
    def __init__(self, field_name: str, count: int, limit: int):
        super().__init__(f"{field_name}: more than {limit} entries ({count} counted so far)")


class NestedTooLarge(ValueError):
    def __init__(self, field_name: str, length: int, limit: int):
        super().__init__(f"{field_name}: one entry of {length} bytes, over the {limit}-byte "
                         "limit on one nested message")


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise DecodeError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise DecodeError("varint longer than 10 bytes")


def _check_counts(counts: list[int], others: dict[int, int], limit: int, name) -> None:
    for number, count in [*enumerate(counts), *others.items()]:
        if count > limit:
            raise TooManyEntries(name(number), count, limit)


def layout(data: bytes, max_entries: int, name=str) -> tuple[list[int], dict[int, int]]:
    """Walk `data`'s top-level fields: where it may be cut (slice boundaries, from 0 to its
    length), and each field number's longest length-delimited entry (of those of 128 bytes
    or more). Raises TooManyEntries as soon as one field has more than `max_entries` entries
    (checked at each cut, so at most a slice past it), DecodeError for bytes that are not a
    message. `name(number)` names a field in errors."""
    n, i, mark = len(data), 0, SLICE_BYTES
    cuts = [0]
    counts = [0] * 16  # fields 1-15, the ones with a one-byte tag
    others: dict[int, int] = {}
    longest: dict[int, int] = {}
    while i < n:
        tag = data[i]
        if tag < 0x80 and tag & 7 == _LEN and i + 1 < n and data[i + 1] < 0x80:
            # The common case, kept short: a one-byte tag and a length under 128.
            i += 2 + data[i + 1]
            counts[tag >> 3] += 1
        else:
            tag, i = _varint(data, i)
            number, kind = tag >> 3, tag & 7
            if number == 0:
                raise DecodeError("field number 0")
            if kind == _LEN:
                length, i = _varint(data, i)
                i += length
                longest[number] = max(longest.get(number, 0), length)
            elif kind == _VARINT:
                _, i = _varint(data, i)
            elif kind == _I64:
                i += 8
            elif kind == _I32:
                i += 4
            else:  # groups: proto2 only, never sent by a client of these services
                raise DecodeError(f"wire type {kind}")
            if number < 16:
                counts[number] += 1
            else:
                others[number] = others.get(number, 0) + 1
        if i >= mark:
            _check_counts(counts, others, max_entries, name)
            cuts.append(min(i, n))
            mark = i + SLICE_BYTES
    if i > n:
        raise DecodeError("the last field runs past the end of the message")
    _check_counts(counts, others, max_entries, name)
    if cuts[-1] != n:
        cuts.append(n)
    return cuts, longest


def decode_in_slices(cls: type[Message], data: bytes, max_entries: int) -> Message:
    """`cls.FromString(data)`, a slice at a time, refusing (TooManyEntries, NestedTooLarge) a payload
    with more entries in one field than `max_entries`, or a nested message larger than
    MAX_NESTED_BYTES, before parsing any of it."""
    fields = cls.DESCRIPTOR.fields_by_number

    def name(number: int) -> str:
        return fields[number].name if number in fields else f"field {number}"

    cuts, longest = layout(data, max_entries, name)
    for number, length in longest.items():
        nested = fields.get(number)
        if (nested is not None and nested.type == FieldDescriptor.TYPE_MESSAGE
                and length > MAX_NESTED_BYTES):
            raise NestedTooLarge(name(number), length, MAX_NESTED_BYTES)
    message = cls()
    view = memoryview(data)
    for start, end in itertools.pairwise(cuts):
        message.MergeFromString(view[start:end])
    return message


def varint_bytes(value: int) -> int:
    return max(1, (int(value).bit_length() + 6) // 7)


def field_bytes(payload: int) -> int:
    """A length-delimited field of `payload` bytes with a one-byte tag (fields 1-15)."""
    return 1 + varint_bytes(payload) + payload
