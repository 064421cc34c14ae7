"""Commands that wire the packages together rather than belonging to one: `clora up`, `clora demo`,
`clora simulate` and `clora config`. The work itself lives in clora/up.py, clora/demo.py and
clora/simulate.py; this module only parses arguments.
"""

from __future__ import annotations

import argparse
import errno
import os
import ssl
import sys
import time

from clora.argtypes import positive, positive_int


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "up",
        parents=[common],
        help="run the whole loop: broker, serving, ingest, learner and compactor as supervised processes",
        description="Starts the embedded broker (unless broker.embedded = false), serving, ingest, the learner and the "
        "compactor; restarts a crashed one; Ctrl-C (or SIGTERM, SIGHUP) stops them in a safe order: compactor, "
        "serving, learner, ingest, broker. Ctrl-C again says how long the child being stopped may take; a third "
        "kills every child at once. Exit 0 after a clean stop, 1 when the stack could not start, 2 for a config or "
        "data_dir problem, 3 when a child had to be killed while stopping.",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "demo",
        parents=[common],
        help="run the loop with simulated apps on the tiny model and report per tenant (make demo)",
        description="Starts the whole loop (clora up) in its own data directory and ports, sends simulated apps' "
        "requests and feedback for a few tenants with hidden preferences, then reports each tenant's reward "
        "before and after and plots it. Exits with 1 when some tenant did not improve.",
    )
    p.add_argument("--minutes", type=positive, default=8.0,
                   help="the most the simulated apps send traffic (default 8); they stop sooner once every tenant "
                   "has learned (its last quarter's reward halfway from its base reward to 1)")
    p.add_argument("--full", action="store_true", help="send traffic for all of --minutes, learned or not")
    p.add_argument("--rate", type=positive, default=6.0, help="requests per second, all tenants together (default 6)")
    p.add_argument("--tenants", default="digits,upper,short",
                   help="comma-separated preferences, one tenant each (so each once): digits, upper, short, json "
                   "(default digits,upper,short)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated traffic (default 0)")
    p.add_argument("--out", default="demo.png",
                   help="where to write the reward plot, its format by its extension: .png, .svg, .pdf, ... "
                   "(default demo.png)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "simulate",
        parents=[common],
        help="simulated apps: chat requests and user feedback for the configured tenants",
        description="Sends chat requests with each configured tenant's key through the openai client and "
        "feedback scores through /v1/feedback according to a hidden per-tenant preference. Exits with 1 when "
        "some tenant had no request succeed, or sooner when serving cannot be reached (its first requests all "
        "fail to connect, or, after it answered, none connects for a minute); 2 for a bad option.",
    )
    p.add_argument("--url", default=None,
                   help="serving base URL, http:// or https:// (default: from the config, serving.host and .port)")
    p.add_argument("--rate", type=positive, default=4.0, help="requests per second, all tenants together (default 4)")
    p.add_argument("--seconds", type=positive, default=60.0, help="how long to run (default 60)")
    p.add_argument("--preferences", default=None,
                   help="comma-separated preferences assigned to the tenants in order, used again in turn when there "
                   "are fewer than tenants (default: from tenant names)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompt sequence and the sampling seeds (default 0)")
    p.add_argument("--max-tokens", type=positive_int, default=24, help="max_tokens of each request (default 24)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("config", parents=[common], help="show the effective configuration or the environment variables "
                       "that override it, or check the set-up it names")
    config_sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    said = "print the effective config (file + environment overrides; keys masked)"
    show = config_sub.add_parser("show", parents=[common], help=said, description=said)
    show.set_defaults(func=config_show)
    said = "list the environment variables that override fields"
    env = config_sub.add_parser("env", parents=[common], help=said, description=said)
    env.set_defaults(func=config_env)
    said = ("check the set-up the config names: data_dir writable, model.path a model, every scorer builds (python "
            "ones import), every prompts_file readable, kafka.bootstrap names the embedded broker, no two of `clora "
            "up`'s processes on one port and none held by another process, Kafka reachable; exit 1 on any problem. "
            "Names the config file first, and lists what `clora up` warns of (no tenants, more ingest processes than "
            "partitions, serving reachable from other hosts without an admin key, api keys left as 'change-me', "
            "keep_versions not above max_staleness) as warnings, which pass")
    check = config_sub.add_parser("check", parents=[common], help=said, description=said)
    check.set_defaults(func=config_check)


def config_show(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args
    from clora.config import show_config
    from clora.up import config_line

    cfg = config_from_args(args)
    print(f"clora: {config_line(cfg, getattr(args, 'config_path', None))}", file=sys.stderr)  # stdout is the config
    print(show_config(cfg))
    return 0


def _tls_context(kafka) -> ssl.SSLContext | None | bool:
    """The TLS context kafka-python would use for `kafka` (a KafkaConfig); None without TLS; False when its
    files cannot be read (reported on their own)."""
    if kafka.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    try:
        context = ssl.create_default_context(cafile=kafka.ssl_cafile)
        if kafka.ssl_certfile is not None:
            context.load_cert_chain(kafka.ssl_certfile, kafka.ssl_keyfile)
    except (OSError, ValueError, ssl.SSLError):
        return False
    context.check_hostname = kafka.ssl_check_hostname
    return context


def config_check(args: argparse.Namespace) -> int:
    """What the config alone cannot tell: whether what it names is there. One line per check, after the line
    naming the config file (or the defaults); then what `clora up` warns of, as warnings that pass."""
    from clora.cli import config_from_args, data_dir_error, model_path_problem, prepare_data_dir
    from clora.up import children_ports, config_line, embedded_broker_problem, port_clashes, ports_in_use, setup_warnings
    from ingest.broker import not_kafka, unreachable
    from ingest.scorers import ScorerSpecError, build_scorer, is_function
    from learner.rollouts import SamplingError, read_prompts_file

    cfg = config_from_args(args)
    print(config_line(cfg, getattr(args, "config_path", None)))
    results: list[tuple[str, str | None]] = []  # (what, problem or None)
    try:
        written = prepare_data_dir(cfg.data_dir, create=False)  # a check creates nothing (a mistyped path stays absent)
        results.append((f"data_dir {cfg.data_dir} is writable" if written == cfg.data_dir else
                        f"data_dir {cfg.data_dir} does not exist yet; clora creates it ({written} is writable)", None))
    except OSError as e:
        results.append(("data_dir", data_dir_error(cfg.data_dir, e).removeprefix("clora: ")))
    if cfg.model.path is None:
        results.append(("model: the tiny local model (built on first use)", None))
    else:
        results.append((f"model.path {cfg.model.path} is a model directory", model_path_problem(cfg.model.path)))
    if cfg.learner.device not in ("auto", "cpu"):
        from learner.policy import device_problem

        results.append((f"learner.device {cfg.learner.device} is on this host", device_problem(cfg.learner.device)))
    for t in cfg.tenants:
        if is_function(t.scorer):
            try:
                build_scorer(t.scorer, time_limit_s=None)
                results.append((f"tenant {t.name}: scorer {t.scorer} builds", None))
            except ScorerSpecError as e:
                results.append((f"tenant {t.name}", f"tenant {t.name}: {e}"))
        if t.prompts_file is not None:
            try:
                n = len(read_prompts_file(t.prompts_file))
                results.append((f"tenant {t.name}: prompts_file {t.prompts_file} has {n} prompts", None))
            except SamplingError as e:
                results.append((f"tenant {t.name}", f"tenant {t.name}: {e}"))
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if (path := getattr(cfg.kafka, name)) is not None:
            try:
                with open(path, "rb"):
                    problem = None
            except OSError as e:
                problem = f"kafka.{name} {path}: {e.strerror or e}"
            results.append((f"kafka.{name} {path} is readable", problem))
    broker_problem = embedded_broker_problem(cfg)
    if broker_problem is not None:
        results.append(("kafka.bootstrap", broker_problem))
    results += [("ports", problem) for problem in port_clashes(cfg)]
    results += [("ports", problem) for problem in ports_in_use(children_ports(cfg))]  # as `up` checks them
    why = unreachable(cfg.kafka.bootstrap)
    tls = _tls_context(cfg.kafka)
    # A port open is not yet Kafka: another service may hold it (with TLS files that cannot be read, reported
    # above, the port is all that can be checked).
    other = None if why is not None or tls is False else not_kafka(cfg.kafka.bootstrap, tls=tls)
    if other is not None:
        results.append(("kafka.bootstrap", f"something takes connections at {cfg.kafka.bootstrap} (kafka.bootstrap), "
                        f"but does not answer a Kafka request: {other}"))
    elif broker_problem is not None:  # the embedded broker would not listen where kafka.bootstrap points (above)
        if why is None:
            results.append((f"Kafka answers at {cfg.kafka.bootstrap}", None))
    elif why is None and cfg.broker.embedded:
        results.append(("kafka.bootstrap", f"Kafka already answers at {cfg.kafka.bootstrap}, where `clora up` starts "
                        "the embedded broker (broker.embedded = true), which it refuses to do while the port is "
                        "held: stop that broker (perhaps an earlier clora still running), or set broker.embedded = "
                        "false to use it"))
    elif why is None:
        results.append((f"Kafka answers at {cfg.kafka.bootstrap}", None))
    elif cfg.broker.embedded:
        results.append((f"Kafka: not running at {cfg.kafka.bootstrap}; `clora up` starts the embedded broker there",
                        None))
    else:
        results.append(("kafka.bootstrap", f"Kafka is not reachable at {cfg.kafka.bootstrap} (kafka.bootstrap, "
                        f"broker.embedded = false): {why}"))
    for what, problem in results:
        print(f"  ok       {what}" if problem is None else f"  PROBLEM  {problem}")
    warnings = setup_warnings(cfg)  # what `clora up` warns of: it works, but wastes something
    for warning in warnings:
        print(f"  warning  {warning}")
    problems = sum(problem is not None for _, problem in results)
    print(f"{problems} problem(s)" if problems else "all checks passed")
    return 1 if problems else 0


def config_env(args: argparse.Namespace) -> int:
    from clora.config import CONFIG_ENV, DEFAULT_CONFIG_FILE, env_variables, unknown_env_variables

    for line in unknown_env_variables().values():  # where one would look for the name that was meant
        print(f"clora: warning: {line}", file=sys.stderr)
    variables = env_variables()
    width = max(len(v) for v in [CONFIG_ENV, *variables])
    print(f"{CONFIG_ENV:{width}}  the config file (when --config is not given; else ./{DEFAULT_CONFIG_FILE} if present)")
    for var, field in variables.items():
        print(f"{var:{width}}  {field}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from clora.cli import base_model_dir, config_from_args, data_dir_error, prepare_data_dir
    from clora.up import up

    cfg = config_from_args(args)
    try:
        prepare_data_dir(cfg.data_dir)
        base_model_dir(cfg)  # built once here rather than by serving and the learner at once; or checked
    except OSError as e:
        print(data_dir_error(cfg.data_dir, e), file=sys.stderr)
        return 2
    return up(cfg, getattr(args, "config_path", None))


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from clora.cli import config_from_args
    from clora.demo import out_problem, run_demo
    from clora.simulate import PREFERENCES

    cfg = config_from_args(args)
    # Every check before run_demo, which deletes the previous demo's data first.
    prefs = [p.strip() for p in args.tenants.split(",") if p.strip()]
    unknown = [p for p in prefs if p not in PREFERENCES]
    if unknown or not prefs:
        what = f"unknown preference(s) {', '.join(unknown)}" if unknown else "--tenants names no preference"
        print(f"clora demo: {what}; choose from {', '.join(PREFERENCES)}", file=sys.stderr)
        return 2
    if repeated := sorted({p for p in prefs if prefs.count(p) > 1}):  # one tenant each: two would share a name
        print(f"clora demo: --tenants names {', '.join(repeated)} more than once; give each preference once",
              file=sys.stderr)
        return 2
    if problem := out_problem(Path(args.out)):
        print(f"clora demo: {problem}", file=sys.stderr)
        return 2
    return run_demo(cfg, minutes=args.minutes, rate=args.rate, preferences=prefs, seed=args.seed,
                    out_png=Path(args.out), full=args.full)


def cmd_simulate(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from clora.cli import config_from_args
    from clora.simulate import PREFERENCES, Simulator, summarise, summary_lines, tenants_from_config

    cfg = config_from_args(args)
    prefs = [p.strip() for p in args.preferences.split(",") if p.strip()] if args.preferences else None
    if unknown := [p for p in prefs or [] if p not in PREFERENCES]:
        print(f"clora simulate: unknown preference(s) {', '.join(unknown)} in --preferences; choose from "
              f"{', '.join(PREFERENCES)}", file=sys.stderr)
        return 2
    tenants = tenants_from_config(cfg, prefs)
    if not tenants:
        print("clora simulate: the config has no tenants", file=sys.stderr)
        return 2
    if prefs and len(prefs) != len(tenants):
        print(f"clora simulate: warning: {len(prefs)} preference(s) for {len(tenants)} tenant(s): "
              f"{'the extra ones are not used' if len(prefs) > len(tenants) else 'they are used again in turn'} "
              f"({', '.join(f'{t.name}: {t.preference}' for t in tenants)})", file=sys.stderr)
    url = args.url or cfg.serving.local_url
    try:
        parts = urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # an unclosed "[", a port that is no number or above 65535
        usable = False
    if not usable:
        print(f"clora simulate: --url {url!r} is not an http:// or https:// URL with a host (e.g. "
              "http://127.0.0.1:8000)", file=sys.stderr)
        return 2
    sim = Simulator(url, tenants, rate=args.rate, duration=args.seconds, seed=args.seed, max_tokens=args.max_tokens)
    try:
        sim.run()
    except KeyboardInterrupt:  # run() waited a moment for the answers in flight: the partial figures
        print(f"clora simulate: interrupted after {time.monotonic() - sim.started:.1f}s: {sim.traffic_line()}",
              file=sys.stderr)
        for line in summary_lines(sim.summary()):
            print(line)
        return 130
    summary = summarise(sim.records, tenants)
    print(f"clora simulate: {sim.traffic_line()}")
    for line in summary_lines(summary):
        print(line)
    if sim.unreachable is not None:  # stopped early: one line for what every failed request had in common
        print(f"clora simulate: {sim.unreachable}", file=sys.stderr)
        return 1
    none_ok = [name for name, s in summary.items() if s["requests"] > 0 and s["requests"] == s["failed"]]
    if none_ok:
        errors = list(dict.fromkeys(r.error for r in sim.records if not r.ok and r.tenant in none_ok))
        print(f"clora simulate: no request succeeded for {', '.join(none_ok)}"
              + (f" (e.g. {errors[0]})" if errors else ""), file=sys.stderr)
        return 1
    return 0
