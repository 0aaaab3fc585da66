"""The flags the `pdserve` commands share, generated from the configs' fields, and what
they resolve to: engine options, the router's config, the model and its resolved dtype,
the deployment secret."""
from __future__ import annotations

import argparse
import os
import typing
from pathlib import Path
from typing import Any

from pdserve.common.config import (ConfigError, EngineOptions, Option, options_of)
from pdserve.common.loading.default_model import resolve_model
from pdserve.router.core.config import RouterConfig


# The engine flags, and serve's worker liveness flags, are generated from the configs'
# fields (common/config.py: each field's type, default and help written once there);
# flags nobody gives stay out of the namespace (SUPPRESS), so the configs' own defaults
# apply, not a copy kept here. Their dests are prefixed, apart from the other flags'
# (`generate --seed` is the sampling seed).
ENGINE_DEST = "engine_"
WORKER_DEST = "worker_"
ROUTER_DEST = "router_"
FLAGS = {"seed": "--engine-seed", "enable_auto_tool_choice": "--enable-auto-tool-choice",  # where config_flag()'s
         "planner_interval_s": "--planner-interval-s", "planner_cooldown_s": "--planner-cooldown-s",
         "planner_memory_s": "--planner-memory-s"}  # rule does not fit
SERVE_WORKER_FIELDS = ("heartbeat_s", "peer_timeout_s", "router_timeout_s", "lease_s", "drain_s", "verify_transfers")
JOIN_WORKER_FIELDS = (*SERVE_WORKER_FIELDS, "rejoin_timeout_s")  # a joined worker outlives its router
SERVE_ROUTER_FIELDS = {  # RouterConfig fields with a flag of their own, by flag group
    "": ("host", "http_port", "zmq_port", "routing", "curve"),
    "tls": ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "zmq_curve"),
    "limits": ("max_prompt_chars", "max_body_bytes"),
    "faults": ("retries", "stale_after_s", "suspect_after_s", "worker_wait_s", "client_timeout_s"),
    "chat": ("enable_auto_tool_choice", "tool_call_parser", "reasoning_parser"),
    "disagg": ("disagg", "disagg_threshold_tokens", "disagg_max_prefill_queue", "disagg_latency_model",
               "disagg_tpot_guard_ms"),
    "planner": ("planner", "slo_ttft_ms", "slo_tpot_ms", "planner_interval_s", "planner_max_workers", "planner_target",
                "planner_sustain", "planner_cooldown_s", "planner_host_cores", "planner_memory_s",
                "planner_load_band", "planner_min_requests", "planner_miss_z", "planner_latency_models"),
}
ROUTER_ALONE_FIELDS = (*SERVE_ROUTER_FIELDS[""], "control_port")  # `pdserve router`: workers join on it


def config_flag(option: Option) -> str:
    """The flag of a config field: --block-size; a seconds field drops `_s` (--lease);
    a bool's flag drops `enable_` and comes with its --no- form (--no-prefix-caching)."""
    if option.name in FLAGS:
        return FLAGS[option.name]
    name = option.name.removeprefix("enable_") if option.type is bool else option.name.removesuffix("_s")
    return "--" + name.replace("_", "-")


def add_config_flags(g: argparse._ArgumentGroup, options: list[Option], dest: str) -> None:
    """One flag per option, typed and helped by its field; its value lands at dest + name."""
    for option in options:
        flag = config_flag(option)
        if option.type is bool:
            g.add_argument(flag, dest=dest + option.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=f"{option.help} (default: {'on' if option.default else 'off'})")
            continue
        default = "" if option.default is None else f" (default: {option.default})"  # None: the help says what
        (kind,) = [t for t in typing.get_args(option.type) or (option.type,) if t is not type(None)]
        g.add_argument(flag, dest=dest + option.name, type=kind, default=argparse.SUPPRESS,
                       metavar=flag[2:].upper().replace("-", "_"), help=option.help + default)


def given(args: argparse.Namespace, dest: str) -> dict[str, Any]:
    """The config fields whose flags were given, by field name."""
    return {name[len(dest):]: value for name, value in vars(args).items() if name.startswith(dest)}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p.add_argument_group("engine"), list(EngineOptions.options().values()), ENGINE_DEST)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine options of the flags given; the rest keep the options' defaults."""
    return EngineOptions.of(**given(args, ENGINE_DEST))


def secret_of(path: str) -> str:
    from pdserve.common.wire.auth import read_secret_file
    try:
        return read_secret_file(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def router_config(args: argparse.Namespace, model: str, options: EngineOptions, max_inflight: int,
                   **fields: Any) -> RouterConfig:
    """The router's config: the model's, the engine options' block size, max_model_len and
    dtype (resolved by the caller), and the router flags given."""
    api_key = args.api_key if args.api_key is not None else os.environ.get("PDSERVE_API_KEY") or None
    router_fields = given(args, ROUTER_DEST)
    no_http = router_fields.get("http_port") == -1
    if no_http:
        router_fields["http_port"] = 0
    return RouterConfig(model_dir=model, model_name=args.served_model_name or Path(model).name,
                        dtype=options.device.dtype, quantization=options.device.quantization,
                        max_model_len=options.scheduler.max_model_len,
                        block_size=options.cache.block_size, enable_http=not no_http, max_inflight=max_inflight,
                        api_key=api_key, **router_fields, **fields)


def resolved_options(args: argparse.Namespace, here: bool = True,
                      workers_device: str | None = None) -> tuple[str, EngineOptions]:
    """The model and the engine options of the flags, with max_model_len and dtype
    resolved from the model: a router and its workers must agree on them (the model
    fingerprint covers the dtype). `here`: the workers run on this machine, so their
    device is checked here too; a Ray driver plans GPU workers it may not have itself.
    `workers_device`: a GPU some workers run on (--prefill-devices cuda:0): `auto` dtype
    and quantization resolve as on it, which every worker can run (a GGUF model's kept
    quantization runs on the CPU only, so on a GPU it is `none` for all)."""
    options = engine_options(args)  # the flags' values are checked before a model is fetched
    model = resolve_model(args.model)
    target = workers_device or options.device.device
    pinned = not here or target != options.device.device
    if pinned:  # dtype and quantization as the workers' device resolves them
        from pdserve.common.checkpoint_dtype import resolve_dtype
        from pdserve.common.quantization import resolve_quantization
        dev = options.device
        options = options.replace(dtype=resolve_dtype(dev.dtype, model, target),
                                  quantization=resolve_quantization(dev.quantization, model, target))
    engine = (options.replace(device="cpu") if pinned else options).engine_config(model)
    return model, options.replace(max_model_len=engine.scheduler.max_model_len, dtype=engine.device.dtype,
                                  quantization=engine.device.quantization)


def add_router_args(p: argparse.ArgumentParser, fields: tuple[str, ...], secret_default: str) -> argparse._ArgumentGroup:
    """The router's flags, shared by `serve` and `router`; returns the fault-tolerance group."""
    router_options = options_of(RouterConfig)
    add_config_flags(p, [router_options[n] for n in fields], ROUTER_DEST)
    p.add_argument("--secret-file", default="", required=not secret_default,
                   help="file (mode 0600) holding the deployment secret, hex"
                        f"{'; default: ' + secret_default if secret_default else ''}. Internal messages are "
                        "authenticated with it; it is never passed in argv or env")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--ready-file", default="", help="write connection info as JSON here once ready")
    add_config_flags(p.add_argument_group("encrypted front ends (docs/security.md)"),
                     [router_options[n] for n in SERVE_ROUTER_FIELDS["tls"]], ROUTER_DEST)
    g = p.add_argument_group("client-facing limits (docs/security.md)")
    g.add_argument("--max-inflight", type=int, default=0,
                   help="requests admitted at once; beyond: HTTP 429 / ZeroMQ 'overloaded' "
                        "(default 4 x max-num-seqs x decode or colocated workers; `router`: x 1)")
    add_config_flags(g, [router_options[n] for n in SERVE_ROUTER_FIELDS["limits"]], ROUTER_DEST)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PDSERVE_API_KEY, else none)")
    g = p.add_argument_group("chat output (vLLM's flags)")
    add_config_flags(g, [router_options[n] for n in SERVE_ROUTER_FIELDS["chat"]], ROUTER_DEST)
    g = p.add_argument_group("conditional disaggregation (docs/slo.md)")
    add_config_flags(g, [router_options[n] for n in SERVE_ROUTER_FIELDS["disagg"]], ROUTER_DEST)
    g = p.add_argument_group("SLO planner (docs/slo.md)")
    add_config_flags(g, [router_options[n] for n in SERVE_ROUTER_FIELDS["planner"]], ROUTER_DEST)
    g = p.add_argument_group("fault tolerance (docs/reliability.md)")
    add_config_flags(g, [router_options[n] for n in SERVE_ROUTER_FIELDS["faults"]], ROUTER_DEST)
    return g
