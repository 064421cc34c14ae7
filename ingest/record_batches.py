"""Reading Kafka record batches within bounds: a batch that cannot be read is one dead letter, not a stop.

kafka-python decompresses a whole record batch into memory before reading its first record, with no limit:
a batch of ~1 MB of zstd can expand to tens of GB (30,000:1 is easy), and ingest would die of it at every
start, since it reads the batch again. A batch whose data does not decompress, whose records do not parse,
or whose checksum fails (a broker that checks nothing on produce, as the embedded one, stores what any
producer sends) made kafka-python raise from `poll` at the same offset at every start: one producer could
stop ingest for good.

`install(max_batch_bytes)` makes kafka-python's batches, in this process, read so:
- compressed data is decompressed in chunks, and a batch past `max_batch_bytes` stops there (snappy's
  blocks state their lengths: all are checked before any is decompressed);
- a batch that cannot be read (too large, data that does not decompress, records that do not parse or
  whose offsets leave the batch's range, a failed checksum) yields, in place of the records not read, one
  record at the batch's last offset whose value is a `SkippedBatch`: the batch as the broker stored it
  (Kafka's record-batch format), with the dead-letter reason and detail. `ingest.events.decode` turns it
  into that dead letter; the consumer's position moves past the batch as after any record, so the batch is
  read once and committed with the rest (a header claiming a last offset before its first is read as
  holding one record: the position would otherwise stay on it);
- a transaction's control batch whose marker cannot be read marks no abort (the fetcher reads it itself);
- bytes left after a batch's last record are ignored (logged), as its records were read whole; so is what
  follows an lz4 batch's first frame, as kafka-python ignored it.

Records read before a record that does not parse are kept: they are events like any other. Message sets
in the formats before Kafka 0.11 (magic 0 and 1) are read within the same bounds, a message failing its
own checksum, a message length too short for a message (kafka-python looped for ever on a negative one)
and a codec id past lz4 included; lz4 in the Kafka 0.8/0.9 framing is refused (`bad_batch`).

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
_LAST_OFFSET_DELTA = 6  # in DefaultRecordBatch._header_data (HEADER_STRUCT's fields)
_LEGACY_CODECS = (0, 1, 2, 3)  # none, gzip, snappy, lz4: the message formats before Kafka 0.11 have no zstd
_XERIAL_HEADER = b"\x82SNAPPY\x00"  # snappy in Java's xerial framing (8 bytes of a 16-byte header)

DEFAULT_MAX_BATCH_BYTES = 64 << 20  # ingest.max_batch_bytes's default
_limit = DEFAULT_MAX_BATCH_BYTES  # set by install(); one per process
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
    def blocks() -> Iterator[memoryview]:
        if data[:8] != _XERIAL_HEADER:
            yield data
            return
        pos = 16  # a 16-byte header, then blocks of [int32 length][raw snappy]
        while pos < len(data):
            (size,) = struct.unpack_from(">i", data, pos)
            if size < 0 or pos + 4 + size > len(data):
                raise ValueError(f"a snappy block's length ({size}) runs past the data")
            yield data[pos + 4:pos + 4 + size]
            pos += 4 + size

    total = 0
    for block in blocks():  # each raw block states its length first: all are checked before any is decompressed
        total += _varint(block)
        if total > _limit:
            raise _too_large("snappy", compressed)
    out = bytearray()
    for block in blocks():
        out += snappy.decompress(block)
    return out


def _lz4(frame: Any, data: memoryview) -> bytearray:
    """The first lz4 frame (what follows it is ignored, as kafka-python's lz4.frame.decompress ignores it)."""
    decompressor, out = frame.LZ4FrameDecompressor(), bytearray()
    out += decompressor.decompress(data, max_length=CHUNK_BYTES)
    while not decompressor.eof:
        if len(out) > _limit:
            raise _too_large("lz4", len(data))
        if decompressor.needs_input:
            raise ValueError("the lz4 frame ends before its end mark")
        out += decompressor.decompress(b"", max_length=CHUNK_BYTES)
    if len(out) > _limit:
        raise _too_large("lz4", len(data))
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
            return _lz4(module, data)
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


def _skipped(batch: Any, offset: int, raw: Any, reason: str, detail: str) -> _SkippedRecord:
    """The record standing for the rest of `batch`, at `offset`; `raw`: the batch as stored (bytes-like)."""
    if batch.magic == 2:
        where, timestamp = f"the record batch at offsets {batch.base_offset}..{offset}", batch.max_timestamp
    else:
        where, timestamp = f"the message set at offset {offset} (message format {batch.magic})", None
    value = SkippedBatch(raw, reason, f"{where}: {detail}; its records (from there) were not read")
    logger.warning("ingest: %s (dead-lettered as %s)", value.detail, reason)
    return _SkippedRecord(offset, timestamp, batch.timestamp_type or 0, value)


def _v2_iter(batch: Any, next_record: Callable[[Any], Any]) -> Iterator[Any]:
    """A v2 batch's records (DefaultRecordBatch.__iter__ in its place)."""
    from kafka.errors import CorruptRecordError

    stored, last = batch._buffer, batch.last_offset  # the batch as stored (copied only when skipped)
    if last < batch.base_offset:
        # The fetcher moves its position to the batch's last offset + 1 once it is read: with a negative
        # delta that is at or before the batch, read again at every fetch. Its header is read as holding one.
        delta = last - batch.base_offset
        batch._header_data = (*batch._header_data[:_LAST_OFFSET_DELTA], 0, *batch._header_data[_LAST_OFFSET_DELTA + 1:])
        yield _skipped(batch, batch.base_offset, stored, "bad_batch", f"its last offset delta is {delta}")
        return
    if batch._decompressed is _CRC_FAILED:
        yield _skipped(batch, last, stored, "bad_batch", "it failed its CRC-32C checksum (damaged on the broker, "
                                                      "or sent so by its producer)")
        return
    if not batch._decompressed:
        if batch.compression_type:
            try:
                data = _decompress(batch.compression_type, memoryview(batch._buffer)[batch._pos:], 2)
            except _Unreadable as e:
                yield _skipped(batch, last, stored, e.reason, e.detail)
                return
            batch._buffer, batch._pos = data, 0
        batch._decompressed = True
    count = batch.records_count
    if count < 0:
        yield _skipped(batch, last, stored, "bad_batch", f"its record count is {count}")
        return
    previous = batch.base_offset - 1
    for i in range(count):
        try:
            record = next_record(batch)
        except CorruptRecordError as e:  # kafka-python's for a record that does not parse
            yield _skipped(batch, max(last, previous + 1), stored, "bad_batch",
                           f"its record {i + 1} of {count} does not parse ({e})"[:500])
            return
        if not previous < record.offset <= last:  # offsets go up within the batch's own range
            yield _skipped(batch, max(last, previous + 1), stored, "bad_batch",
                           f"its record {i + 1} of {count} has offset {record.offset}, outside "
                           f"{previous + 1}..{last}")
            return
        previous = record.offset
        yield record
    if batch._pos != len(batch._buffer):
        logger.warning("ingest: the record batch at offsets %d..%d has %d bytes after its %d records; ignored",
                       batch.base_offset, last, len(batch._buffer) - batch._pos, count)


def _legacy_iter(batch: Any, original: Callable[[Any], Iterator[Any]]) -> Iterator[Any]:
    """A message set's records in the formats before Kafka 0.11 (LegacyRecordBatch.__iter__ in its place)."""
    from kafka.errors import CorruptRecordError

    stored, last = batch._buffer, batch._offset
    if batch._decompressed is _CRC_FAILED:
        yield _skipped(batch, last, stored, "bad_batch", "it failed its CRC-32 checksum")
        return
    if batch.compression_type not in _LEGACY_CODECS:
        yield _skipped(batch, last, stored, "bad_batch", f"its codec id {batch.compression_type} is not one of its format")
        return
    read, previous = 0, -1
    try:
        for record in original(batch):
            if not record.validate_crc():
                raise CorruptRecordError(f"message at offset {record.offset} failed its CRC-32 checksum")
            if not previous < record.offset <= last:
                raise CorruptRecordError(f"offset {record.offset} is outside {previous + 1}..{last}")
            read, previous = read + 1, record.offset
            yield record
    except _Unreadable as e:
        yield _skipped(batch, last, stored, e.reason, e.detail)
    except (CorruptRecordError, ValueError, IndexError, AssertionError, struct.error) as e:  # kafka-python's parse errors
        yield _skipped(batch, max(last, previous + 1), stored, "bad_batch",
                       f"its message {read + 1} does not parse ({type(e).__name__}: {e})"[:500])


def _legacy_headers(batch: Any) -> list[tuple[tuple, int]]:
    """LegacyRecordBatch._read_all_headers, refusing a length that does not move past the message header
    (kafka-python's loops forever on a negative one, growing its list)."""
    from kafka.errors import CorruptRecordError

    pos, headers = 0, []
    while pos < len(batch._buffer):
        header = batch._read_header(pos)
        if header[1] < batch.RECORD_OVERHEAD_V0:  # the smallest message: no key, no value
            raise CorruptRecordError(f"a message's length is {header[1]}")
        headers.append((header, pos))
        pos += batch.LOG_OVERHEAD + header[1]
    return headers


def _checked_crc(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """validate_crc that marks a failed batch for its iteration (which yields its dead letter) and passes.
    The mark is `_decompressed` (the classes have slots, no room for another attribute): the fetcher checks
    a batch's checksum before it reads a record of it."""

    def validate_crc(batch: Any) -> bool:
        if not original(batch):
            batch._decompressed = _CRC_FAILED
        return True

    return validate_crc


def _control_next(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """DefaultRecordBatch.__next__, which the fetcher calls itself on a transaction's control batch (to see
    whether it marks an abort): one that cannot be read marks nothing (None, as kafka-python takes a marker
    it does not find) rather than raising at that offset at every start."""
    from kafka.errors import CorruptRecordError

    def next_record(batch: Any) -> Any:
        if not batch.is_control_batch:
            return original(batch)
        try:
            record = original(batch)
            record.abort  # noqa: B018 (reads the marker's key: a key of another length raises here)
            return record
        except (StopIteration, CorruptRecordError, ValueError, IndexError, struct.error) as e:
            logger.warning("ingest: the control batch at offset %d cannot be read (%s: %s); taken as no abort marker",
                           batch.base_offset, type(e).__name__, e)
            return None

    return next_record


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
                                "max_timestamp", "is_control_batch")] + [
        (legacy, n) for n in ("__iter__", "_decompress", "validate_crc", "_read_all_headers", "_read_header",
                              "RECORD_OVERHEAD_V0", "LOG_OVERHEAD")]
    missing = [f"{cls.__name__}.{name}" for cls, name in needed if not hasattr(cls, name)]
    if missing or not kafka.__version__.startswith("3."):
        raise RuntimeError(f"kafka-python {kafka.__version__} is not the 3.x this ingest reads batches of "
                           f"(missing: {', '.join(missing) or 'none'}); install kafka-python 3")
    next_record, legacy_original = v2.__next__, legacy.__iter__
    v2.__iter__ = lambda batch: _v2_iter(batch, next_record)
    v2.__next__ = _control_next(next_record)
    legacy._read_all_headers = _legacy_headers
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
