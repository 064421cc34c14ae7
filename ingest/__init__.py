"""ingest: the Kafka consumer process that turns interaction and feedback events into Parquet.

    events.py    wire types (InteractionEvent, FeedbackEvent, DeadLetter), decode / encode
    scorers.py   reward functions built from a tenant's scorer spec
    rows.py      wire events -> storage rows -> Arrow tables
    index.py     KeyIndex: keys already stored, 12 bytes each
    pending.py   the in-memory view of the store: what is stored, which feedback waits
    batch.py     one batch of records -> rows to write (validate, score, deduplicate, join)
    consumer.py  the Kafka loop: flush, durable write, commit, rebalance
    metrics.py   log lines and Prometheus metrics
    process.py   main() -> run(): config, signals (`python -m ingest`, `clora ingest`)
    broker.py    the embedded Kafka-compatible broker (tests, demo)
    bench.py     `clora bench ingest`
"""
