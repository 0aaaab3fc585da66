"""`pdserve`'s engine flags (and serve's worker liveness flags) are generated from the
configs (common/config.py): every option has a flag, a flag nobody gives leaves the
config's own default, and the help text is the field's."""
from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from pdserve.common.config import EngineOptions, WorkerConfig, options_of
from pdserve.router.cli.flags import ENGINE_DEST, SERVE_WORKER_FIELDS, WORKER_DEST, config_flag, engine_options, given
from pdserve.router.cli.main import build_parser

COMMANDS = ("generate", "serve")


@pytest.mark.parametrize("command", COMMANDS)
def test_no_config_flag_gives_the_configs_defaults(command):
    args = build_parser().parse_args([command])
    assert engine_options(args) == EngineOptions()
    assert not [dest for dest in vars(args) if dest.startswith(ENGINE_DEST)]  # the CLI holds no default of its own


def _other(value: object) -> str:
    """A flag value other than the default, valid for the option."""
    return {16: "32", 0.2: "0.5", 64: "8", 2048: "4096", "cpu": "cuda:0", "float32": "bfloat16", "auto": "float32", 0: "7"}.get(value, "3")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_a_flag_that_sets_it(command):
    for name, option in EngineOptions.options().items():
        if option.type is bool:
            flag = config_flag(option) if not option.default else "--no-" + config_flag(option)[2:]
            argv, want = [flag], not option.default
        else:
            value = {"quantization": "none", "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}
            argv = [config_flag(option), value.get(name) or _other(option.default)]
            (kind,) = [t for t in typing.get_args(option.type) or (option.type,) if t is not type(None)]  # X | None: X
            want = kind(argv[1])
        got = engine_options(build_parser().parse_args([command, *argv])).to_dict()
        assert got == {**EngineOptions().to_dict(), name: want}, argv


def test_the_established_flags_keep_their_spelling():
    args = build_parser().parse_args(["serve", "--block-size", "32", "--num-kv-blocks", "64", "--max-model-len", "256",
                                      "--no-prefix-caching", "--decode-graphs", "--num-threads", "1"])
    assert engine_options(args) == EngineOptions.of(block_size=32, num_kv_blocks=64, max_model_len=256,
                                                    enable_prefix_caching=False, decode_graphs=True, num_threads=1)
    args = build_parser().parse_args(["generate", "--seed", "5", "--engine-seed", "9"])  # sampling seed vs engine seed
    assert args.seed == 5 and engine_options(args).seed == 9


def test_help_shows_each_options_help_and_default():
    out = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    text = " ".join(out.split())  # argparse wraps lines
    for option in EngineOptions.options().values():
        shown = "on" if option.default is True else "off" if option.default is False else option.default
        after = "" if option.default is None else f" (default: {shown})"  # a None default's help says what it means
        assert f"{config_flag(option)} " in text and " ".join((option.help + after).split()) in text, option.name


def test_a_bad_flag_value_exits_2_naming_the_option(capsys):
    from pdserve.router.cli.main import main
    assert main(["generate", "/no/such/model", "--block-size", "24"]) == 2
    assert "block_size must be a positive power of two, got 24" in capsys.readouterr().err


def test_serves_worker_liveness_flags_come_from_worker_config():
    assert given(build_parser().parse_args(["serve"]), WORKER_DEST) == {}  # WorkerConfig's defaults apply
    fields = options_of(WorkerConfig)
    argv = ["serve", "--heartbeat", "0.25", "--lease", "5", "--verify-transfers"]
    assert given(build_parser().parse_args(argv), WORKER_DEST) == {"heartbeat_s": 0.25, "lease_s": 5.0,
                                                                   "verify_transfers": True}
    assert [config_flag(fields[n]) for n in SERVE_WORKER_FIELDS] == [
        "--heartbeat", "--peer-timeout", "--router-timeout", "--lease", "--drain", "--verify-transfers"]
    assert all(fields[n].help for n in SERVE_WORKER_FIELDS)


def test_serve_router_flags_come_from_router_config():
    from pdserve.router.cli.flags import ROUTER_DEST, SERVE_ROUTER_FIELDS
    from pdserve.router.core.config import RouterConfig
    options = options_of(RouterConfig)
    names = [n for group in SERVE_ROUTER_FIELDS.values() for n in group]
    assert not given(build_parser().parse_args(["serve"]), ROUTER_DEST)  # RouterConfig's defaults apply
    args = build_parser().parse_args(["serve", "--host", "10.0.0.1", "--http-port", "-1", "--zmq-port", "0",
                                      "--routing", "round_robin", "--max-prompt-chars", "100", "--max-body-bytes",
                                      "2048", "--retries", "0", "--stale-after", "2.5", "--client-timeout", "3",
                                      "--curve", "on", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
                                      "--ssl-ca-certs", "ca.pem", "--zmq-curve",
                                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--reasoning-parser", "qwen3",
                                      "--disagg", "cost", "--disagg-threshold-tokens", "64", "--disagg-max-prefill-queue",
                                      "900", "--disagg-latency-model", "lm.json", "--disagg-tpot-guard-ms", "50",
                                      "--planner", "slo", "--slo-ttft-ms", "200", "--slo-tpot-ms", "40",
                                      "--planner-interval-s", "2", "--planner-max-workers", "4", "--planner-target",
                                      "0.95", "--planner-sustain", "2", "--planner-cooldown-s", "10",
                                      "--planner-host-cores", "2", "--planner-memory-s", "60",
                                      "--planner-load-band", "2", "--planner-min-requests", "6", "--planner-miss-z", "1.5",
                                      "--planner-latency-models", "a.json,b.json",
                                      "--suspect-after", "0.75", "--worker-wait", "4"])
    assert given(args, ROUTER_DEST) == {"host": "10.0.0.1", "http_port": -1, "zmq_port": 0, "routing": "round_robin",
                                        "max_prompt_chars": 100, "max_body_bytes": 2048, "retries": 0,
                                        "stale_after_s": 2.5, "client_timeout_s": 3.0, "curve": "on",
                                        "ssl_keyfile": "k.pem", "ssl_certfile": "c.pem", "ssl_ca_certs": "ca.pem",
                                        "zmq_curve": True, "enable_auto_tool_choice": True,
                                        "tool_call_parser": "hermes", "reasoning_parser": "qwen3", "disagg": "cost",
                                        "disagg_threshold_tokens": 64, "disagg_max_prefill_queue": 900,
                                        "disagg_latency_model": "lm.json", "disagg_tpot_guard_ms": 50.0,
                                        "planner": "slo", "slo_ttft_ms": 200.0, "slo_tpot_ms": 40.0,
                                        "planner_interval_s": 2.0, "planner_max_workers": 4, "planner_target": 0.95,
                                        "planner_sustain": 2, "planner_cooldown_s": 10.0, "planner_host_cores": 2,
                                        "planner_memory_s": 60.0, "planner_load_band": 2.0, "planner_min_requests": 6,
                                        "planner_miss_z": 1.5, "planner_latency_models": "a.json,b.json", "suspect_after_s": 0.75,
                                        "worker_wait_s": 4.0}
    assert sorted(given(args, ROUTER_DEST)) == sorted(names)
    for name in names:
        assert options[name].help, f"RouterConfig.{name} has no help text for its flag"


def test_worker_command_flags_fill_only_worker_config_fields():
    args = build_parser().parse_args(["worker", "m", "--role", "decode", "--join", "tcp://10.0.0.1:7000",
                                      "--host", "10.0.0.2", "--secret-file", "s", "--worker-id", "d-a",
                                      "--heartbeat", "0.2", "--block-size", "32"])
    assert given(args, WORKER_DEST) == {"heartbeat_s": 0.2}  # only WorkerConfig fields, nothing else
    assert (args.role, args.join, args.host, args.name) == ("decode", "tcp://10.0.0.1:7000", "10.0.0.2", "d-a")
    assert engine_options(args).cache.block_size == 32


def test_router_command_has_the_control_port_and_needs_a_secret_file(capsys):
    args = build_parser().parse_args(["router", "--control-port", "7000", "--secret-file", "s"])
    assert given(args, "router_") == {"control_port": 7000}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--control-port", "7000"])
    assert "--secret-file" in capsys.readouterr().err


def test_worker_refuses_a_join_address_that_is_not_tcp(tmp_path):
    from pdserve.router.cli.main import main
    assert main(["worker", "--role", "prefill", "--join", "ipc:///tmp/x", "--secret-file", str(tmp_path / "s")]) == 2


def test_make_model_writes_qwen3s_template_when_asked(tmp_path):
    from pdserve.common.text.qwen3_template import QWEN3_CHAT_TEMPLATE
    from pdserve.common.text.tokenizer import Tokenizer
    from pdserve.router.cli.main import main
    assert main(["make-model", str(tmp_path / "m"), "--chat-template", "qwen3"]) == 0
    tok = Tokenizer(tmp_path / "m")
    assert tok.chat_template.where.endswith("tokenizer_config.json")
    assert len(tok.encode("<tool_call></tool_call><think></think>")) == 4
    assert "<tool_call>" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                     tools=[{"type": "function", "function": {"name": "f"}}])
    assert (tmp_path / "m" / "tokenizer_config.json").read_text().count("multi_step_tool") == \
        QWEN3_CHAT_TEMPLATE.count("multi_step_tool")


def test_config_refuses_unknown_parsers_and_auto_without_one():
    from pdserve.common.config import ConfigError
    from pdserve.router.core.config import RouterConfig
    for bad in ({"tool_call_parser": "xml"}, {"reasoning_parser": "o1"}, {"enable_auto_tool_choice": True}):
        with pytest.raises(ConfigError):
            RouterConfig(model_dir="m", **bad)
    RouterConfig(model_dir="m", enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1")


def _serve_args(*flags: str):
    args = build_parser().parse_args(["serve", *flags])
    if not args.colocated:
        args.prefill = 1 if args.prefill is None else args.prefill
        args.decode = 1 if args.decode is None else args.decode
    return args


def test_serve_workers_run_on_device_unless_their_role_names_devices():
    from pdserve.router.cli.serve import _worker_devices
    assert _worker_devices(_serve_args("--device", "cuda:0", "--decode", "2")) == {
        "prefill": ("cuda:0",), "decode": ("cuda:0", "cuda:0")}
    assert _worker_devices(_serve_args("--device", "cuda:0", "--decode-devices", "cpu")) == {
        "prefill": ("cuda:0",), "decode": ("cpu",)}
    assert _worker_devices(_serve_args("--colocated", "2")) == {"colocated": ("cpu", "cpu")}


def _as_if_from_gguf(model_dir: str, tmp_path) -> str:
    """A copy of `model_dir` that names a GGUF file it came from (what `convert_gguf`
    leaves), so `auto` quantization keeps the GGUF's types on the CPU."""
    import shutil

    from pdserve.common.quantization import write_gguf_source
    folder = shutil.copytree(model_dir, tmp_path / "from-gguf")
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    write_gguf_source(folder, source)
    return str(folder)


def test_serve_resolves_auto_precision_as_its_gpu_workers_do(model_dirs, tmp_path):
    """A GGUF's kept quantization runs on the CPU only: with P and D on a GPU, `auto`
    resolves to the dequantized weights for every worker (before, the router resolved it
    for the CPU and the GPU workers exited refusing `gguf`). Explicit CPU-only
    quantization with GPU workers is refused before anything starts."""
    from pdserve.common.config import ConfigError
    from pdserve.router.cli.flags import resolved_options as _resolved_options
    model = _as_if_from_gguf(model_dirs["llama"], tmp_path)
    _, on_cpu = _resolved_options(_serve_args(model))
    assert on_cpu.device.quantization == "gguf"
    _, on_gpu = _resolved_options(_serve_args(model), workers_device="cuda:0")
    assert (on_gpu.device.quantization, on_gpu.device.dtype) == ("none", "float32")
    with pytest.raises(ConfigError, match="runs on the CPU only"):
        _resolved_options(_serve_args(model, "--quantization", "int8"), workers_device="cuda:0")


def test_generate_answers_and_exits_0(model_dir, capsys):
    from pdserve.router.cli.main import main
    assert main(["generate", model_dir, "--prompt", "hello", "--max-tokens", "4", "--num-kv-blocks", "64", "--max-model-len", "256",
                 "--num-threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("'hello' -> ") and "[4 tokens, length]" in out


def test_generate_sizes_its_kv_cache_to_its_prompts(model_dir, capsys, monkeypatch):
    """Without --num-kv-blocks, an offline job's cache holds each prompt's sequence up to
    max_model_len (3 prompts x 256 / 16 blocks), not memory_fraction of the host; with it,
    what was asked."""
    from pdserve.common.engine import llm as llm_module
    from pdserve.router.cli.main import main
    made = []
    real = llm_module.LLM.__init__

    def spy(self, model, **options):
        made.append(options["num_kv_blocks"])
        real(self, model, **options)
    monkeypatch.setattr(llm_module.LLM, "__init__", spy)
    flags = ["--max-tokens", "2", "--max-model-len", "256", "--num-threads", "1"]
    assert main(["generate", model_dir, *[a for p in "abc" for a in ("--prompt", p)], *flags]) == 0
    assert main(["generate", model_dir, "--prompt", "a", "--num-kv-blocks", "40", *flags]) == 0
    assert made == [3 * 256 // 16, 40]
    capsys.readouterr()


def test_generate_exits_1_naming_the_cause_when_a_prompt_fails(model_dir, capsys, monkeypatch):
    """An answer that is an error (here every step's forward raises) fails the job."""
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.router.cli.main import main

    def broken(*args, **kwargs):
        raise RuntimeError("the forward is broken")
    monkeypatch.setattr(ModelRunner, "execute", broken)
    assert main(["generate", model_dir, "--prompt", "a", "--prompt", "b", "--max-tokens", "4",
                 "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1"]) == 1
    err = capsys.readouterr().err
    assert "2 of 2 prompts failed" in err and "the forward is broken" in err


def test_generate_with_a_broken_model_exits_non_zero(tmp_path):
    """A model folder whose weights are not safetensors: a clear error and a non-zero exit."""
    import shutil

    from pdserve.common.loading.model_factory import make_model
    model = make_model(tmp_path / "m", "llama", "tiny", seed=0)
    for f in Path(model).glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    run = subprocess.run([sys.executable, "-m", "pdserve", "generate", str(model), "--max-tokens", "2",
                          "--num-threads", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode != 0, run.stdout
    assert "->" not in run.stdout
    shutil.rmtree(model)
