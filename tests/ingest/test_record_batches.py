"""Record batches read within bounds (ingest.record_batches): a decompression bomb stops at
ingest.max_batch_bytes, and a batch that cannot be read is one dead letter at its last offset, in place of
its records; the consumer's position moves past it either way.

The batches are built here byte by byte (Kafka's v2 record-batch format; kafka-python's own builder for the
records inside and for the older formats) and read by kafka-python's real fetcher code
(Fetcher.PartitionRecords), as a fetch response's bytes would be. The same against the real broker and the
ingest process: test_ingest_process.py.
"""

from __future__ import annotations

import logging
import struct
import sys
import tracemalloc
import zlib

import lz4.frame
import pytest
import snappy
import zstandard
from kafka.codec import gzip_encode, lz4_encode, snappy_encode, zstd_encode
from kafka.consumer.fetcher import Fetcher, IsolationLevel
from kafka.errors import UnsupportedCodecError
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from kafka.record.legacy_records import LegacyRecordBatchBuilder
from kafka.record.util import calc_crc32, calc_crc32c
from kafka.structs import TopicPartition

from clora.config import Config, ConfigError, load_config
from ingest import record_batches
from ingest.events import DeadLetter, InteractionEvent, SkippedBatch, decode, encode

pytestmark = pytest.mark.unit

TP = TopicPartition("t.i", 0)
BASE = 100  # the batches' first offset
LIMIT = 8 << 20  # max_batch_bytes in these tests
GZIP, SNAPPY, LZ4, ZSTD = 1, 2, 3, 4
CODECS = {"gzip": GZIP, "snappy": SNAPPY, "lz4": LZ4, "zstd": ZSTD}
ENCODE = {GZIP: gzip_encode, SNAPPY: snappy_encode, LZ4: lz4_encode, ZSTD: zstd_encode}


@pytest.fixture(autouse=True)
def limit():
    record_batches.install(LIMIT)


def records_section(values: list[bytes]) -> bytes:
    """The records of an uncompressed v2 batch, as kafka-python's builder writes them (offset deltas 0..n-1)."""
    builder = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, batch_size=1 << 30)
    for i, value in enumerate(values):
        builder.append(i, timestamp=1_700_000_000_000, key=b"acme", value=value, headers=[])
    return bytes(builder.build()[DefaultRecordBatch.HEADER_STRUCT.size:])


def v2_batch(payload: bytes, *, codec: int, count: int, last_delta: int | None = None) -> bytes:
    """A v2 record batch at offset BASE holding `payload` (the records, compressed with `codec`), its length
    and CRC-32C right."""
    ts = 1_700_000_000_000
    header = DefaultRecordBatch.HEADER_STRUCT.pack(
        BASE, 0, 0, 2, 0, codec, count - 1 if last_delta is None else last_delta, ts, ts, -1, -1, -1, count)
    buf = bytearray(header + payload)
    struct.pack_into(">i", buf, 8, len(buf) - 12)
    struct.pack_into(">I", buf, DefaultRecordBatch.CRC_OFFSET, calc_crc32c(bytes(buf[DefaultRecordBatch.ATTRIBUTES_OFFSET:])))
    return bytes(buf)


def fetch(*batches: bytes, fetch_offset: int = BASE) -> tuple[list, int]:
    """What kafka-python's fetcher makes of a fetch response holding `batches`: its records and the offset
    it fetches next."""
    partition = Fetcher.PartitionRecords(fetch_offset, TP, MemoryRecords(b"".join(batches)))
    records = partition.take()
    return records, partition.next_fetch_offset


def events(n: int, tag: str = "e") -> list[bytes]:
    return [encode(InteractionEvent(id=f"{tag}{i}", tenant="acme", prompt="p", completion="c")) for i in range(n)]


def zeros_zstd(total: int) -> bytes:
    c = zstandard.ZstdCompressor().compressobj()
    return b"".join(c.compress(bytes(1 << 20)) for _ in range(total >> 20)) + c.flush()


def zeros_gzip(total: int) -> bytes:
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    return b"".join(c.compress(bytes(1 << 20)) for _ in range(total >> 20)) + c.flush()


def zeros_lz4(total: int) -> bytes:
    c = lz4.frame.LZ4FrameCompressor(block_linked=False)
    return c.begin() + b"".join(c.compress(bytes(1 << 20)) for _ in range(total >> 20)) + c.flush()


def zeros_snappy(total: int) -> bytes:
    """Java's xerial framing (as kafka-python writes it): a 16-byte header, then [int32 length][block]."""
    header = snappy_encode(b"x")[:16]
    block = snappy.compress(bytes(32 << 10))
    return header + (struct.pack(">i", len(block)) + block) * (total // (32 << 10))


BOMBS = {"zstd": (ZSTD, zeros_zstd, 1 << 30), "gzip": (GZIP, zeros_gzip, 128 << 20),
         "lz4": (LZ4, zeros_lz4, 512 << 20), "snappy": (SNAPPY, zeros_snappy, 256 << 20)}


@pytest.mark.parametrize("codec", sorted(BOMBS))
def test_a_decompression_bomb_stops_at_the_limit_and_is_one_dead_letter(codec):
    """Kilobytes that expand to a gigabyte: kafka-python decompressed the whole of it before reading a
    record (and ingest died of it, at every start). Now decompression stops past max_batch_bytes."""
    codec_id, zeros, expands_to = BOMBS[codec]
    batch = v2_batch(zeros(expands_to), codec=codec_id, count=1000)
    assert len(batch) * 16 < expands_to  # snappy expands at most ~21x; the others far more
    tracemalloc.start()
    try:
        records, next_offset = fetch(batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The limit, the codec's and the fetcher's buffers, and a few copies of the compressed batch (whose size
    # the broker and the fetch bound): not what it expands to.
    bound = LIMIT * 1.5 + 4 * record_batches.CHUNK_BYTES + 4 * len(batch)
    assert peak < bound < expands_to / 3, f"{peak} bytes held reading a {codec} bomb of {expands_to}"
    (record,) = records
    assert (record.offset, next_offset) == (BASE + 999, BASE + 1000)
    assert isinstance(record.value, SkippedBatch) and record.value == batch and record.key is None
    dead = decode(record.value, max_bytes=1000)
    assert dead == DeadLetter("batch_too_large", dead.detail)
    assert dead.detail.startswith(f"the record batch at offsets {BASE}..{BASE + 999}: its ")
    assert f"bytes of {codec} decompress to more than ingest.max_batch_bytes ({LIMIT})" in dead.detail


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_compressed_batches_within_the_limit_are_read_as_before(codec):
    values = events(200)
    section = records_section(values)
    records, next_offset = fetch(v2_batch(ENCODE[CODECS[codec]](section), codec=CODECS[codec], count=200))
    assert [r.value for r in records] == values
    assert [r.offset for r in records] == list(range(BASE, BASE + 200)) and next_offset == BASE + 200


def test_a_batch_just_over_the_limit_is_a_dead_letter_and_one_at_it_is_read():
    """The limit is on the records as decompressed, the bytes kafka-python would hold."""
    values = [bytes(1000)] * 100
    section = records_section(values)
    record_batches.install(len(section))
    records, _ = fetch(v2_batch(zstd_encode(section), codec=ZSTD, count=100))
    assert [r.value for r in records] == values
    record_batches.install(len(section) - 1)
    (record,), _ = fetch(v2_batch(zstd_encode(section), codec=ZSTD, count=100))
    assert record.value.reason == "batch_too_large"


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_data_that_does_not_decompress_is_one_dead_letter_and_the_next_batch_is_read(codec):
    """A producer wrote a batch whose data is not its codec's (a broker that checks nothing on produce
    stores it): kafka-python raised from poll at that offset at every start."""
    bad = v2_batch(b"\x28\xb5\x2f\xfd\x82SNAPPY\x00not compressed data at all", codec=CODECS[codec], count=5)
    good_values = events(3, "after")
    good = v2_batch(records_section(good_values), codec=0, count=3)
    good = good[:0] + struct.pack(">q", BASE + 5) + good[8:]  # the next batch's base offset (not in the CRC)
    records, next_offset = fetch(bad, good)
    assert [r.offset for r in records] == [BASE + 4, BASE + 5, BASE + 6, BASE + 7] and next_offset == BASE + 8
    dead = decode(records[0].value, max_bytes=1000)
    assert dead.reason == "bad_batch" and records[0].value == bad
    assert dead.detail.startswith(f"the record batch at offsets {BASE}..{BASE + 4}: ")
    assert [r.value for r in records[1:]] == good_values


def test_a_batch_that_fails_its_checksum_is_one_dead_letter():
    batch = bytearray(v2_batch(records_section(events(4)), codec=0, count=4))
    batch[-3] ^= 0xFF  # inside the last record's value: the CRC-32C no longer matches
    (record,), next_offset = fetch(bytes(batch))
    assert (record.offset, next_offset) == (BASE + 3, BASE + 4)
    assert record.value == bytes(batch)
    dead = decode(record.value, max_bytes=1000)
    assert dead.reason == "bad_batch" and "failed its CRC-32C checksum" in dead.detail


def test_the_records_before_one_that_does_not_parse_are_read_and_the_rest_is_one_dead_letter():
    values = events(5)
    section = bytearray(records_section(values))
    third = len(records_section(values[:2]))  # where record 3 starts: its length varint
    section[third] = 0x7E  # a length of 63 bytes: record 3's fields no longer line up
    records, next_offset = fetch(v2_batch(bytes(section), codec=0, count=5))
    assert [r.value for r in records[:2]] == values[:2]
    assert len(records) == 3 and records[2].offset == BASE + 4 and next_offset == BASE + 5
    assert decode(records[2].value, max_bytes=1000).reason == "bad_batch"
    assert "its record 3 of 5 does not parse" in records[2].value.detail


def test_a_record_count_past_the_records_is_a_dead_letter_after_those_there_are():
    values = events(2)
    records, _ = fetch(v2_batch(records_section(values), codec=0, count=2_000_000_000, last_delta=1))
    assert [r.value for r in records[:2]] == values
    assert records[2].value.reason == "bad_batch" and "its record 3 of 2000000000" in records[2].value.detail
    (record,), _ = fetch(v2_batch(records_section(values), codec=0, count=-1, last_delta=1))
    assert record.value.reason == "bad_batch" and "its record count is -1" in record.value.detail


def test_bytes_after_the_last_record_are_ignored_and_logged(caplog):
    """kafka-python raised for them, after every record was read whole."""
    values = events(3)
    with caplog.at_level(logging.WARNING, logger="ingest.record_batches"):
        records, next_offset = fetch(v2_batch(records_section(values) + b"\x00\x01\x02", codec=0, count=3))
    assert [r.value for r in records] == values and next_offset == BASE + 3
    assert "has 3 bytes after its 3 records; ignored" in caplog.text


def test_the_older_message_formats_are_read_within_the_same_bounds():
    """Message format 1 (Kafka 0.10): a compressed message set is one wrapper message; its bomb is one dead
    letter at the wrapper's offset, and a readable one is read as before."""
    def message_set(values: list[bytes], codec: int) -> bytes:
        builder = LegacyRecordBatchBuilder(magic=1, compression_type=codec, batch_size=1 << 30)
        for i, value in enumerate(values):
            builder.append(i, timestamp=1_700_000_000_000, key=None, value=value)
        buf = bytearray(builder.build())
        struct.pack_into(">q", buf, 0, BASE + len(values) - 1)  # the broker's offset of the wrapper: its last
        return bytes(buf)

    values = events(20)
    records, _ = fetch(message_set(values, GZIP))
    assert [r.value for r in records] == values
    bomb = message_set([bytes(1 << 20)] * 16, GZIP)  # 16 MiB of zeros, in ~16 KB
    (record,), next_offset = fetch(bomb)
    assert (record.offset, next_offset) == (BASE + 15, BASE + 16) and record.value == bomb
    dead = decode(record.value, max_bytes=1000)
    assert dead.reason == "batch_too_large" and "the message set at offset 115 (message format 1)" in dead.detail


def test_an_unreadable_transaction_marker_is_taken_as_no_abort_and_reading_goes_on(caplog):
    """Reading committed records only, the fetcher reads a control batch's marker itself: one that did not
    parse raised at that offset at every start."""
    good_values = events(2)
    good = bytearray(v2_batch(records_section(good_values), codec=0, count=2))
    struct.pack_into(">q", good, 0, BASE + 1)
    for payload, count in [(b"\x10junkjunkjunk", 1), (b"", 0), (records_section([b"x"]), 1)]:  # its key: not 4 bytes
        control = bytearray(v2_batch(payload, codec=0x30, count=count))  # the control and transactional bits
        struct.pack_into(">qh", control, 43, 7, 0)  # a producer id and epoch, as a transaction's
        struct.pack_into(">I", control, DefaultRecordBatch.CRC_OFFSET,
                         calc_crc32c(bytes(control[DefaultRecordBatch.ATTRIBUTES_OFFSET:])))
        partition = Fetcher.PartitionRecords(BASE, TP, MemoryRecords(bytes(control) + bytes(good)),
                                             isolation_level=IsolationLevel.READ_COMMITTED)
        assert [r.value for r in partition.take()] == good_values and partition.next_fetch_offset == BASE + 3
    assert "taken as no abort marker" in caplog.text


def test_offsets_outside_the_batch_end_it_and_a_negative_last_offset_moves_the_position_past_it():
    values = events(3)
    records, next_offset = fetch(v2_batch(records_section(values), codec=0, count=3, last_delta=1))
    assert [r.value for r in records[:2]] == values[:2] and "has offset 102, outside 102..101" in records[2].value.detail
    (record,), next_offset = fetch(v2_batch(b"junk", codec=ZSTD, count=3, last_delta=-1))
    assert (record.offset, next_offset) == (BASE, BASE + 1)  # not BASE: the same batch read again, for ever
    assert "its last offset delta is -1" in record.value.detail


def test_snappy_in_tiny_blocks_is_bounded_by_the_limit_not_by_its_block_count():
    """A view per block was held before any was decompressed: ~40 bytes of memory per byte of the batch."""
    header = snappy_encode(b"x")[:16]
    batch = v2_batch(header + (struct.pack(">i", 1) + b"\x00") * 20_000, codec=SNAPPY, count=1)
    tracemalloc.start()
    try:
        (record,), _ = fetch(batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(batch) and record.value.reason == "bad_batch"


def test_lz4_data_after_the_first_frame_is_ignored_as_kafka_python_ignored_it():
    values = events(20)
    section = records_section(values)
    for tail in (b"\x00" * 8, b"junk", lz4_encode(b"another frame")):
        records, _ = fetch(v2_batch(lz4_encode(section) + tail, codec=LZ4, count=20))
        assert [r.value for r in records] == values


def test_a_message_set_with_a_damaged_message_a_bad_length_or_no_such_codec_is_a_dead_letter():
    """The format before Kafka 0.11: a message failing its own checksum raised at every start, a negative
    length looped for ever (growing a list), codec ids past lz4 asked for a codec to be installed."""
    def wrapper(inner: bytes, codec: int) -> bytes:
        value = gzip_encode(inner) if codec == GZIP else inner
        body = struct.pack(">bbqii", 1, codec, 1_700_000_000_000, -1, len(value)) + value
        message = struct.pack(">I", calc_crc32(body)) + body
        return struct.pack(">qi", BASE + 2, len(message)) + message

    builder = LegacyRecordBatchBuilder(magic=1, compression_type=0, batch_size=1 << 30)
    values = events(3)
    for i, value in enumerate(values):
        builder.append(i, timestamp=1_700_000_000_000, key=None, value=value)
    damaged = bytearray(builder.build())
    damaged[-2] ^= 0xFF  # inside the third message's value
    records, next_offset = fetch(wrapper(bytes(damaged), GZIP))
    assert [r.value for r in records[:2]] == values[:2] and next_offset == BASE + 3
    assert "failed its CRC-32 checksum" in records[2].value.detail
    negative = struct.pack(">qiIbbq", 0, -12, 0, 1, 0, 1) + struct.pack(">ii", -1, 1) + b"x"
    (record,), _ = fetch(wrapper(negative, GZIP))
    assert record.value.reason == "bad_batch" and "a message's length is -12" in record.value.detail
    (record,), _ = fetch(wrapper(b"whatever", ZSTD))
    assert record.value.reason == "bad_batch" and "codec id 4" in record.value.detail


def test_a_codec_library_not_installed_stops_ingest_rather_than_dead_letter_a_readable_batch(monkeypatch):
    """The batch may be fine: that is for the installation to mend (the consumer's BrokerError says what to
    install), not a reason to skip it."""
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard: ImportError
    with pytest.raises(UnsupportedCodecError, match="zstd"):
        fetch(v2_batch(zstd_encode(records_section(events(3))), codec=ZSTD, count=3))


def test_only_the_consumer_makes_a_skipped_batch():
    """A producer's message with a skipped batch's very bytes is decoded as any message is."""
    batch = v2_batch(b"junk", codec=ZSTD, count=1)
    assert decode(batch, max_bytes=1000).reason in ("not_utf8", "not_json")
    assert decode(SkippedBatch(batch, "bad_batch", "why"), max_bytes=10) == DeadLetter("bad_batch", "why")


def test_max_batch_bytes_must_hold_a_batch_of_one_largest_message(tmp_path):
    config = tmp_path / "clora.toml"
    config.write_text("[ingest]\nmax_message_bytes = 1000000\nmax_batch_bytes = 1000000\n")
    with pytest.raises(ConfigError, match=r"max_batch_bytes \(1000000\) must be at least max_message_bytes"):
        load_config(config)
    assert Config().ingest.max_batch_bytes == record_batches.DEFAULT_MAX_BATCH_BYTES == 64 << 20
