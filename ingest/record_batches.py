"""Reading Kafka record batches within bounds: a batch that cannot be read is one dead letter, not a stop.

kafka-python decompresses a whole record batch into memory before reading its first record, with no limit:
a batch of ~1 MB of zstd can expand to tens of GB (30,000:1 is easy), and ingest would die of it at every
start, since it reads the batch again. A batch whose data does not decompress, whose records do not parse,
or whose checksum fails (a broker that checks nothing on produce, as the embedded one, stores what any
producer sends) made kafka-python raise from `poll` at the same offset at every start: one producer could
stop ingest for good.

`install(max_batch_bytes)` makes kafka-python's batches, in this process, read so:
- compressed data is decompressed in chunks, and a batch past `max_batch_bytes` stops there;
- a batch that cannot be read (too large, data that does not decompress, records that do not parse, a
  failed checksum) yields, in place of the records not read, one record at the batch's last offset whose
  value is a `SkippedBatch`: the batch as the broker stored it (Kafka's record-batch format), with the
  dead-letter reason and detail. `ingest.events.decode` turns it into that dead letter; the consumer's
  position moves past the batch as after any record, so the batch is read once and committed with the rest.
- bytes left after a batch's last record are ignored (logged), as its records were read whole.

Records read before a record that does not parse are kept: they are events like any other. Batches in the
message formats before Kafka 0.11 (magic 0 and 1) are read within the same bounds, except that lz4 in the
Kafka 0.8/0.9 framing is refused (`bad_batch`).

Only the consumer's reading changes: kafka-python's producers and what it writes are untouched. The
patched methods are kafka-python 3's (checked at install: another version refuses to start, naming it).
"""

from __future__ import annotations

import gzip
import io
import logging
import struct
from collections.abc import Callable, Iterator
from typing import Any

from ingest.events import SkippedBatch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # decompressed per read: what a batch over the limit may allocate past it
_CODECS = {1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
_XERIAL_HEADER = b"\x82SNAPPY\x00"  # snappy in Java's xerial framing (8 bytes of a 16-byte header)

_limit = 64 << 20  # set by install(); one per process
_CRC_FAILED = object()  # a batch's `_decompressed` once its checksum failed (_checked_crc)
_installed = False


class _Unreadable(Exception):
    """A batch's data cannot be read: `reason` (batch_too_large, bad_batch) and `detail`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------------------------------------------------
# Bounded decompression


def _too_large(codec: str, compressed: int) -> _Unreadable:
    return _Unreadable("batch_too_large", f"its {compressed} bytes of {codec} decompress to more than "
                                          f"ingest.max_batch_bytes ({_limit})")


def _read_stream(stream: Any, codec: str, compressed: int) -> bytearray:
    out = bytearray()
    while chunk := stream.read(CHUNK_BYTES):
        out += chunk
        if len(out) > _limit:
            raise _too_large(codec, compressed)
    return out


def _varint(data: memoryview, pos: int = 0) -> int:
    """An unsigned little-endian base-128 varint (snappy's uncompressed length)."""
    value = shift = 0
    for i in range(pos, min(pos + 5, len(data))):
        value |= (data[i] & 0x7F) << shift
        if not data[i] & 0x80:
            return value
        shift += 7
    raise ValueError("the snappy block's length is not a varint")


def _snappy(snappy: Any, data: memoryview, compressed: int) -> bytearray:
    if data[:8] == _XERIAL_HEADER:  # 16-byte header, then blocks of [int32 length][raw snappy]
        blocks, pos = [], 16
        while pos < len(data):
            (size,) = struct.unpack_from(">i", data, pos)
            if size < 0 or pos + 4 + size > len(data):
                raise ValueError(f"a snappy block's length ({size}) runs past the data")
            blocks.append(data[pos + 4:pos + 4 + size])
            pos += 4 + size
    else:
        blocks = [data]
    if sum(_varint(b) for b in blocks) > _limit:  # each raw block states its length first: checked before any
        raise _too_large("snappy", compressed)
    out = bytearray()
    for block in blocks:
        out += snappy.decompress(block)
    return out


def _codec_module(codec: str) -> Any:
    """The codec's library: one not installed is kafka-python's UnsupportedCodecError (ingest stops, naming
    what to install), not a dead letter, as the batch itself may be fine."""
    from kafka.errors import UnsupportedCodecError

    try:
        if codec == "zstd":
            import zstandard
            return zstandard
        if codec == "lz4":
            import lz4.frame
            return lz4.frame
        if codec == "snappy":
            import snappy
            return snappy
        return gzip
    except ImportError as e:
        raise UnsupportedCodecError(f"{codec} ({e})") from e


def _decompress(codec_id: int, data: memoryview, magic: int) -> bytearray:
    """`data` decompressed, within the limit; no copy of it is made but gzip's and lz4's (they read a file)."""
    codec = _CODECS.get(codec_id)
    if codec is None:
        raise _Unreadable("bad_batch", f"its compression codec id {codec_id} is not one Kafka defines")
    module = _codec_module(codec)
    try:
        if codec == "gzip":
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
                return _read_stream(f, codec, len(data))
        if codec == "zstd":
            with module.ZstdDecompressor().stream_reader(data, read_across_frames=True) as f:
                return _read_stream(f, codec, len(data))
        if codec == "lz4":
            if magic == 0:
                raise _Unreadable("bad_batch", "lz4 in the framing of Kafka 0.8/0.9 (message format 0) is not read")
            with module.LZ4FrameFile(io.BytesIO(data), "rb") as f:
                return _read_stream(f, codec, len(data))
        return _snappy(module, data, len(data))
    except (_Unreadable, MemoryError):
        raise
    except Exception as e:  # the codecs' own errors (zstd, zlib, lz4, snappy), truncated data, and the like
        raise _Unreadable("bad_batch", f"its {codec} data does not decompress ({type(e).__name__}: {e})"[:500]) from e


# ---------------------------------------------------------------------------------------------------------
# The records a batch yields


class _SkippedRecord:
    """What kafka-python's fetcher reads of a record, standing for the records of a batch not read."""

    __slots__ = ("offset", "timestamp", "timestamp_type", "value")
    key = headers = checksum = None
    size_in_bytes = 0

    def __init__(self, offset: int, timestamp: int | None, timestamp_type: int, value: SkippedBatch) -> None:
        self.offset, self.timestamp, self.timestamp_type, self.value = offset, timestamp, timestamp_type, value

    def validate_crc(self) -> bool:
        return True


def _skipped(batch: Any, offset: int, raw: bytes, reason: str, detail: str) -> _SkippedRecord:
    if batch.magic == 2:
        where, timestamp = f"the record batch at offsets {batch.base_offset}..{offset}", batch.max_timestamp
    else:
        where, timestamp = f"the message set at offset {offset} (message format {batch.magic})", None
    value = SkippedBatch(raw, reason, f"{where}: {detail}; its records were not read")
    logger.warning("ingest: %s (dead-lettered as %s)", value.detail, reason)
    return _SkippedRecord(offset, timestamp, batch.timestamp_type or 0, value)


def _v2_iter(batch: Any, next_record: Callable[[Any], Any]) -> Iterator[Any]:
    """A v2 batch's records (DefaultRecordBatch.__iter__ in its place)."""
    from kafka.errors import CorruptRecordError

    stored, last = batch._buffer, batch.last_offset  # the batch as stored (bytes() of it only when skipped)
    if batch._decompressed is _CRC_FAILED:
        yield _skipped(batch, last, bytes(stored), "bad_batch", "it failed its CRC-32C checksum (damaged on the broker, "
                                                      "or sent so by its producer)")
        return
    if not batch._decompressed:
        if batch.compression_type:
            try:
                data = _decompress(batch.compression_type, memoryview(batch._buffer)[batch._pos:], 2)
            except _Unreadable as e:
                yield _skipped(batch, last, bytes(stored), e.reason, e.detail)
                return
            batch._buffer, batch._pos = data, 0
        batch._decompressed = True
    count = batch.records_count
    if count < 0:
        yield _skipped(batch, last, bytes(stored), "bad_batch", f"its record count is {count}")
        return
    for i in range(count):
        try:
            record = next_record(batch)
        except CorruptRecordError as e:  # kafka-python's for a record that does not parse
            yield _skipped(batch, last, bytes(stored), "bad_batch", f"its record {i + 1} of {count} does not parse ({e})"[:500])
            return
        yield record
    if batch._pos != len(batch._buffer):
        logger.warning("ingest: the record batch at offsets %d..%d has %d bytes after its %d records; ignored",
                       batch.base_offset, last, len(batch._buffer) - batch._pos, count)


def _legacy_iter(batch: Any, original: Callable[[Any], Iterator[Any]]) -> Iterator[Any]:
    """A message set's records in the formats before Kafka 0.11 (LegacyRecordBatch.__iter__ in its place)."""
    from kafka.errors import CorruptRecordError

    raw, last = bytes(batch._buffer), batch._offset
    if batch._decompressed is _CRC_FAILED:
        yield _skipped(batch, last, raw, "bad_batch", "it failed its CRC-32 checksum")
        return
    read = 0
    try:
        for record in original(batch):
            read += 1
            yield record
    except _Unreadable as e:
        yield _skipped(batch, last, raw, e.reason, e.detail)
    except (CorruptRecordError, ValueError, IndexError, AssertionError, struct.error) as e:  # kafka-python's parse errors
        yield _skipped(batch, last, raw, "bad_batch", f"its message {read + 1} does not parse ({type(e).__name__}: {e})"[:500])


def _checked_crc(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """validate_crc that marks a failed batch for its iteration (which yields its dead letter) and passes.
    The mark is `_decompressed` (the classes have slots, no room for another attribute): the fetcher checks
    a batch's checksum before it reads a record of it."""

    def validate_crc(batch: Any) -> bool:
        if not original(batch):
            batch._decompressed = _CRC_FAILED
        return True

    return validate_crc


def install(max_batch_bytes: int) -> None:
    """Reads kafka-python's record batches in this process as the module docstring says; `max_batch_bytes`:
    the most a batch may decompress to (the last install's limit holds for every consumer in the process)."""
    global _limit, _installed
    _limit = max_batch_bytes
    if _installed:
        return
    import kafka
    from kafka.record import default_records, legacy_records

    v2, legacy = default_records.DefaultRecordBatch, legacy_records.LegacyRecordBatch
    needed = [(v2, n) for n in ("__next__", "_read_msg", "validate_crc", "records_count", "last_offset",
                                "max_timestamp")] + [(legacy, n) for n in ("__iter__", "_decompress", "validate_crc")]
    missing = [f"{cls.__name__}.{name}" for cls, name in needed if not hasattr(cls, name)]
    if missing or not kafka.__version__.startswith("3."):
        raise RuntimeError(f"kafka-python {kafka.__version__} is not the 3.x this ingest reads batches of "
                           f"(missing: {', '.join(missing) or 'none'}); install kafka-python 3")
    next_record, legacy_original = v2.__next__, legacy.__iter__
    v2.__iter__ = lambda batch: _v2_iter(batch, next_record)
    v2.validate_crc = _checked_crc(v2.validate_crc)
    legacy.validate_crc = _checked_crc(legacy.validate_crc)
    legacy.__iter__ = lambda batch: _legacy_iter(batch, legacy_original)

    def bounded(codec_id: int, magic: int) -> Callable[[bytes], bytearray]:
        return lambda data: _decompress(codec_id, memoryview(data), magic)

    # The legacy format decompresses in _decompress, through these names.
    legacy_records.gzip_decode = bounded(1, 1)
    legacy_records.snappy_decode = bounded(2, 1)
    legacy_records.lz4_decode = bounded(3, 1)
    legacy_records.lz4_decode_old_kafka = bounded(3, 0)
    _installed = True
