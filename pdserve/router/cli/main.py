"""`pdserve` command line: the parser of every command and the entry point."""
from __future__ import annotations

import argparse
import sys

from pdserve.common.config import (KV_TRANSFER_CHOICES, SUPPORTED_ARCHS, ConfigError, WorkerConfig,
                                   options_of)
from pdserve.common.loading.default_model import resolve_model
from pdserve.common.loading.model_sizes import SIZES as MODEL_SIZES
from pdserve.router.cli.flags import (JOIN_WORKER_FIELDS, ROUTER_ALONE_FIELDS, WORKER_DEST, add_config_flags, add_engine_args,
                                      add_router_args, engine_options)
from pdserve.router.cli.offline import CHAT_PROMPTS, PLAIN_PROMPTS, cmd_convert_gguf, cmd_generate, cmd_make_model  # noqa: F401
from pdserve.router.cli.serve import cmd_router, cmd_serve, cmd_worker
from pdserve.router.cli.ray import add_ray_flags, add_ray_stop_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random-weight HF-format model with a trained tokenizer")
    p.add_argument("dir")
    p.add_argument("--arch", choices=SUPPORTED_ARCHS, default=None,
                   help="default: the size's family (llama3-8b: llama), else qwen3")
    p.add_argument("--size", choices=list(MODEL_SIZES), default="tiny",
                   help="tiny, small: test models (float32); the others: published families' exact shapes, bf16")
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
    add_engine_args(p)
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
    g = add_router_args(p, ROUTER_ALONE_FIELDS, "a fresh one per run")
    g.add_argument("--restart", action="store_true", help="start a worker again when its process exits")
    g = add_ray_flags(p)
    worker = options_of(WorkerConfig)
    add_config_flags(g, [worker[name] for name in JOIN_WORKER_FIELDS], WORKER_DEST)  # rejoin: under --ray
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    add_ray_stop_parser(sub)

    p = sub.add_parser("router", help="start the router alone; workers join it from any host (docs/deploy.md)")
    p.add_argument("model", nargs="?", default=None, help="model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    add_router_args(p, ROUTER_ALONE_FIELDS, "")
    add_engine_args(p)  # block size, dtype and max_model_len: the workers must match them
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
    add_engine_args(p)
    p.set_defaults(func=cmd_worker)

    from pdserve.router.cli import profile
    p = sub.add_parser("profile", help="measure prefill, decode step and KV transfer times; write a latency model "
                                       "(docs/slo.md)")
    profile.add_arguments(p)
    add_engine_args(p)
    p.set_defaults(func=lambda args: profile.main(args, resolve_model(args.model), engine_options(args)))

    from pdserve.router.pools import client as control_client
    p = sub.add_parser("scale", help="grow, shrink or drain a running deployment's pools (docs/deploy.md)")
    control_client.add_scale_arguments(p)
    p.set_defaults(func=control_client.scale_main)
    p = sub.add_parser("pools", help="list a running deployment's workers by pool and state")
    control_client.add_common_arguments(p)
    p.set_defaults(func=control_client.pools_main)

    from pdserve.router.cli import simulate as simulate_cli
    p = sub.add_parser("simulate", help="replay a trace against a simulated deployment (the router's routing, the "
                                        "engine's schedulers, a latency model); --search finds the best split")
    simulate_cli.add_arguments(p)
    p.set_defaults(func=simulate_cli.main)

    from pdserve.router.cli import bench as bench_cli
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
