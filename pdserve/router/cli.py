"""`pdserve` command line: make-model, generate (offline), and the serving commands."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import typing
from pathlib import Path
from typing import Any

from pdserve.common.config import (KV_TRANSFER_CHOICES, SUPPORTED_ARCHS, ConfigError, EngineOptions, Option, WorkerConfig,
                           options_of)
from pdserve.common.loading.default_model import resolve_model
from pdserve.common.quantization import kept_linears
from pdserve.router.config import RouterConfig
from pdserve.router.ray_cli import add_ray_flags, add_ray_stop_parser, ray_placement, serve_with_ray


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
    "faults": ("retries", "stale_after_s", "client_timeout_s"),
    "chat": ("enable_auto_tool_choice", "tool_call_parser", "reasoning_parser"),
    "disagg": ("disagg", "disagg_threshold_tokens", "disagg_max_prefill_queue", "disagg_latency_model",
               "disagg_tpot_guard_ms"),
    "planner": ("planner", "slo_ttft_ms", "slo_tpot_ms", "planner_interval_s", "planner_max_workers", "planner_target",
                "planner_sustain", "planner_cooldown_s", "planner_host_cores", "planner_memory_s",
                "planner_load_band", "planner_min_requests", "planner_latency_models"),
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


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p.add_argument_group("engine"), list(EngineOptions.options().values()), ENGINE_DEST)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine options of the flags given; the rest keep the options' defaults."""
    return EngineOptions.of(**given(args, ENGINE_DEST))


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from pdserve.common.loading.gguf_convert import convert_gguf
    out = convert_gguf(args.gguf, args.out_dir)
    print(f"wrote {out} (float32 safetensors, config, tokenizer, chat template) from {args.gguf}")
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.common.loading.model_factory import make_model
    out = make_model(args.dir, args.arch, args.size, args.seed, chat_template=args.chat_template)
    print(f"wrote {args.arch}/{args.size} model (seed {args.seed}) to {out}")
    return 0


CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Give me two tips for writing clear code.", "What does a GPU do, in one sentence?"]
PLAIN_PROMPTS = ["The router sends the request to", "A prefill worker computes",
                 "Hello, my name is", "Decode workers stream tokens"]


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.common import LLM, SamplingParams
    options = engine_options(args)  # the flags' values are checked before a model is fetched
    model = resolve_model(args.model)
    llm = LLM(model, **options.to_dict())
    # the default model is an instruct model: by default each prompt is a user's chat turn
    chat = args.chat if args.chat is not None else args.model is None
    prompts = args.prompt or (CHAT_PROMPTS if chat else PLAIN_PROMPTS)
    inputs = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
              for p in prompts] if chat else prompts
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params)
    dt = time.perf_counter() - t0
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, **out}))
        else:
            print(f"{prompt!r} -> {out['text']!r}  [{len(out['token_ids'])} tokens, {out['finish_reason']}]")
    ntok = sum(len(o["token_ids"]) for o in outs)
    dev = llm.engine.config.device  # the precision it ran in: `auto` resolved, and how many linears each kind
    kept = " + ".join(f"{len(ws)} {kind}" for kind, ws in kept_linears(llm.engine.runner.model).items())
    print(f"model {model} ({dev.dtype}, quantization {dev.quantization}{f': {kept} linears' if kept else ''}): "
          f"{len(outs)} prompts, {ntok} tokens in {dt:.2f} s", file=sys.stderr)
    return 0


def _devices(spec: str | None, count: int, flag: str, default: str = "cpu") -> tuple[str, ...]:
    """`--prefill 2 --prefill-devices cuda:0,cuda:1`; `default` (--device) for all when no
    devices are given."""
    if not spec:
        return (default,) * count
    devs = tuple(d.strip() for d in spec.split(",") if d.strip())
    if len(devs) != count:
        raise ConfigError(f"{flag} lists {len(devs)} devices for {count} workers")
    return devs


def _worker_devices(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """Each role's workers' devices: the role's --*-devices flag, else --device for all."""
    default = engine_options(args).device.device
    if args.colocated:
        return {"colocated": _devices(args.colocated_devices, args.colocated, "--colocated-devices", default)}
    return {"prefill": _devices(args.prefill_devices, args.prefill, "--prefill-devices", default),
            "decode": _devices(args.decode_devices, args.decode, "--decode-devices", default)}


def cmd_serve(args: argparse.Namespace) -> int:
    """Fill the DeploymentConfig once from the flags, then run it."""
    from pdserve.router.deploy import plan_deployment
    from pdserve.router.serve import run
    placement = ray_placement(args)  # None: every worker on this machine
    if args.colocated and (args.prefill or args.decode):
        raise ConfigError("use either --colocated K or --prefill N --decode M, not both")
    if not args.colocated:
        args.prefill = 1 if args.prefill is None else args.prefill
        args.decode = 1 if args.decode is None else args.decode
    if not args.colocated and (args.prefill < 1 or args.decode < 1):
        raise ConfigError("a disaggregated deployment needs --prefill >= 1 and --decode >= 1 (or --colocated K)")
    devices = _worker_devices(args)
    model, options = _resolved_options(args, here=placement is None,
                                       workers_device=next((d for ds in devices.values() for d in ds if d != "cpu"), None))
    n_workers = args.colocated or (args.prefill + args.decode)
    threads = options.device.num_threads or max(1, (os.cpu_count() or 1) // n_workers)
    if placement is not None:
        return serve_with_ray(args, placement, model, options)
    # admission: every decode-side worker's batch, 4 times over (queued on the workers included)
    max_inflight = args.max_inflight or 4 * options.scheduler.max_num_seqs * (args.colocated or args.decode)
    router = _router_config(args, model, options, max_inflight, restart_workers=args.restart)
    timeouts = given(args, WORKER_DEST)
    if args.colocated:
        dep = plan_deployment(router, options, threads_per_worker=threads, worker_timeouts=timeouts,
                              colocated_devices=devices["colocated"])
    else:
        dep = plan_deployment(router, options, kv_transfer=args.kv_transfer, threads_per_worker=threads,
                              worker_timeouts=timeouts, prefill_devices=devices["prefill"],
                              decode_devices=devices["decode"])
    if args.secret_file:  # multi-host: every host's workers are given the same secret this way
        dep = dataclasses.replace(dep, secret=_secret(args.secret_file))
    run(dep, args.ready_file)
    return 0


def _secret(path: str) -> str:
    from pdserve.common.wire.auth import read_secret_file
    try:
        return read_secret_file(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _router_config(args: argparse.Namespace, model: str, options: EngineOptions, max_inflight: int,
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


def _resolved_options(args: argparse.Namespace, here: bool = True,
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


def cmd_router(args: argparse.Namespace) -> int:
    """The router and its front ends alone; workers join it (`pdserve worker --join`)."""
    from pdserve.router.deploy import DeploymentConfig
    from pdserve.router.serve import run
    model, options = _resolved_options(args)
    max_inflight = args.max_inflight or 4 * options.scheduler.max_num_seqs
    router = _router_config(args, model, options, max_inflight)
    run(DeploymentConfig(router, (), secret=_secret(args.secret_file)), args.ready_file)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """One worker that registers with the router at --join; it runs in this process."""
    import socket

    from pdserve.common.worker.spec import WorkerSpec
    from pdserve.common.worker.host import pair_transport
    from pdserve.common.worker.router_link import EXIT_ROUTER_LOST, RouterLost
    from pdserve.common.wire.curve import resolve as resolve_curve
    from pdserve.common.wire.transport import is_endpoint
    if not is_endpoint(args.join) or not args.join.startswith("tcp://"):
        raise ConfigError(f"--join must be the router's control address, tcp://HOST:PORT, got {args.join!r}")
    model, options = _resolved_options(args)
    # a joined worker's peers may be on any host, so `auto` is tcp here (common/worker/host.py)
    kv_transfer = "auto" if args.role == "colocated" else pair_transport(args.kv_transfer, options.device.device, None)
    worker_id = args.name or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    wconfig = WorkerConfig(role=args.role, worker_id=worker_id, bind=f"tcp://{args.host}:{args.port}",
                           kv_transfer=kv_transfer, report_to=args.join, host_id=args.host_id,
                           secret=_secret(args.secret_file), ready_file=args.ready_file,
                           curve=resolve_curve(args.curve, [args.join], shared_secret=True),
                           **given(args, WORKER_DEST))
    spec = WorkerSpec(model, options, wconfig)
    print(f"pdserve worker {worker_id}: {args.role}, kv transfer {kv_transfer}, joining {args.join}, "
          f"CurveZMQ {'on' if wconfig.curve else 'off'}",
          file=sys.stderr, flush=True)
    if args.role == "prefill":
        from pdserve.prefill_node.worker import serve
    else:
        from pdserve.decode_node.worker import serve
    try:
        serve(spec.engine_config(), spec.worker)
    except RouterLost:  # the worker has logged why
        return EXIT_ROUTER_LOST
    return 0


def _add_router_args(p: argparse.ArgumentParser, fields: tuple[str, ...], secret_default: str) -> argparse._ArgumentGroup:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random-weight HF-format model with a trained tokenizer")
    p.add_argument("dir")
    p.add_argument("--arch", choices=SUPPORTED_ARCHS, default="qwen3")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", choices=["simple", "qwen3"], default="simple",
                   help="simple: role and content only; qwen3: Qwen3's own (tools, <think>), with its added tokens")
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("convert-gguf", help="convert a llama/qwen2/qwen3 GGUF file to a HuggingFace-format folder")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out_dir", help="the folder to write (must not exist, or be empty)")
    p.set_defaults(func=cmd_convert_gguf)

    p = sub.add_parser("generate", help="offline generation (default model when none is given)")
    p.add_argument("model", nargs="?", default=None, help="model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="send each prompt as a user chat turn through the model's chat template "
                        "(default: on for the default instruct model, off when MODEL is given)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="start the router and workers (default model when none is given)")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--prefill", type=int, default=None, help="number of prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=None, help="number of decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0, help="run K colocated workers instead of P/D")
    p.add_argument("--prefill-devices", default=None, help="e.g. cuda:0,cuda:1 (default cpu)")
    p.add_argument("--decode-devices", default=None)
    p.add_argument("--colocated-devices", default=None)
    p.add_argument("--kv-transfer", default="auto", choices=KV_TRANSFER_CHOICES)
    g = _add_router_args(p, ROUTER_ALONE_FIELDS, "a fresh one per run")
    g.add_argument("--restart", action="store_true", help="start a worker again when its process exits")
    g = add_ray_flags(p)
    worker = options_of(WorkerConfig)
    add_config_flags(g, [worker[name] for name in JOIN_WORKER_FIELDS], WORKER_DEST)  # rejoin: under --ray
    _add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    add_ray_stop_parser(sub)

    p = sub.add_parser("router", help="start the router alone; workers join it from any host (docs/deploy.md)")
    p.add_argument("model", nargs="?", default=None, help="model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    _add_router_args(p, ROUTER_ALONE_FIELDS, "")
    _add_engine_args(p)  # block size, dtype and max_model_len: the workers must match them
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("worker", help="start one worker that joins a router (docs/deploy.md)")
    p.add_argument("model", nargs="?", default=None,
                   help="the model folder on this machine (default: SmolLM2-135M-Instruct); the router "
                        "refuses a worker whose model or dtype differs from its own")
    p.add_argument("--role", required=True, choices=("prefill", "decode", "colocated"))
    p.add_argument("--join", required=True, metavar="tcp://HOST:PORT",
                   help="the router's control address (`pdserve router --host HOST --control-port PORT`)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address this worker binds and announces: the router and the other workers "
                        "connect to it, so it must be reachable from their hosts (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="the port to bind (default: a free one)")
    p.add_argument("--host-id", default="",
                   help="this machine's identity for 'same host' decisions (default: the kernel's boot id "
                        "and the network namespace)")
    p.add_argument("--worker-id", dest="name", default="", help="default: ROLE-HOSTNAME-PID")
    p.add_argument("--kv-transfer", default="auto", choices=KV_TRANSFER_CHOICES,
                   help="auto: tcp (a joined worker's peers may be on any host)")
    p.add_argument("--secret-file", required=True,
                   help="file (mode 0600) holding the deployment secret, hex: the router's")
    p.add_argument("--ready-file", default="", help="write this worker's address as JSON here once it is bound")
    p.add_argument("--curve", default="auto", choices=("auto", "on", "off"),
                   help="CurveZMQ encryption of this worker's sockets; it must match the router's "
                        "(auto: on, as a joined worker's secret comes from a file)")
    worker = options_of(WorkerConfig)
    add_config_flags(p.add_argument_group("liveness"), [worker[name] for name in JOIN_WORKER_FIELDS], WORKER_DEST)
    _add_engine_args(p)
    p.set_defaults(func=cmd_worker)

    from pdserve.router import profile
    p = sub.add_parser("profile", help="measure prefill, decode step and KV transfer times; write a latency model "
                                       "(docs/slo.md)")
    profile.add_arguments(p)
    _add_engine_args(p)
    p.set_defaults(func=lambda args: profile.main(args, resolve_model(args.model), engine_options(args)))

    from pdserve.router import control_client
    p = sub.add_parser("scale", help="grow, shrink or drain a running deployment's pools (docs/deploy.md)")
    control_client.add_scale_arguments(p)
    p.set_defaults(func=control_client.scale_main)
    p = sub.add_parser("pools", help="list a running deployment's workers by pool and state")
    control_client.add_common_arguments(p)
    p.set_defaults(func=control_client.pools_main)

    from pdserve.router.simulate import cli as simulate_cli
    p = sub.add_parser("simulate", help="replay a trace against a simulated deployment (the router's routing, the "
                                        "engine's schedulers, a latency model); --search finds the best split")
    simulate_cli.add_arguments(p)
    p.set_defaults(func=simulate_cli.main)

    from pdserve.router.bench import cli as bench_cli
    p = sub.add_parser("bench", help="replay a workload against a running server and report latency/SLO metrics")
    bench_cli.add_arguments(p)
    p.set_defaults(func=bench_cli.main)
    p = sub.add_parser("bench-plot", help="plot SLO attainment vs rate for several `pdserve bench` sweeps")
    bench_cli.add_plot_arguments(p)
    p.set_defaults(func=bench_cli.plot_main)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
