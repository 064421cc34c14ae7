"""clora's serving tier: one vLLM engine with every tenant's LoRA adapter behind an OpenAI-compatible API.

    __main__.py       the process: build everything from the config, serve until stopped
    cli.py            `clora serve`
    api.py            HTTP routes: completions (streaming too), models, feedback, health, metrics
    protocol.py       OpenAI request/response shapes
    auth.py           bearer key -> tenant; request `model` -> base, current adapter or a version
    errors.py         refusals with their HTTP status and OpenAI error shape
    engine.py         the vLLM AsyncLLM, driven by token ids; per-token logprobs
    adapters.py       hot-swap: registry -> validated, loaded, leased adapter versions
    adapter_check.py  adapter validation (every problem in one error)
    events_log.py     interaction/feedback events to Kafka from a background thread
    spool.py          the on-disk spool for events Kafka could not take yet
    metrics.py        Prometheus metrics per tenant
    bench.py          `clora bench serving`; bench_swap.py: `clora bench swap`
"""
