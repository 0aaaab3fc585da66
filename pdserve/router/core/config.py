"""The router's frozen configuration; socket addresses derive from it in one place."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import CacheConfig, ConfigError, option
from pdserve.common.wire.curve import MODES as CURVE_MODES
from pdserve.router.core.disagg_policy import MODES as DISAGG_MODES
from pdserve.router.core.policy import POLICIES
from pdserve.router.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

PLANNERS = ("none", "slo")
MAX_WORKER_WAIT_S = 3600.0  # a held request holds an admission slot: an hour is already generous


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, how it routes, and the client-facing limits
    (docs/security.md, "Client-facing edge")."""

    model_dir: str
    model_name: str = "pdserve"
    dtype: str = "float32"  # the deployment\'s engine dtype (resolved, never "auto"): part of the model fingerprint
    quantization: str = "none"  # its weight quantization (resolved, never "auto"): part of the fingerprint too
    host: str = option("127.0.0.1", "the address the HTTP, ZeroMQ and control sockets bind")
    http_port: int = option(8000, "OpenAI HTTP port; 0 picks a free port, -1 serves no HTTP")
    zmq_port: int = option(5555, "client ZeroMQ port; 0 picks a free port")
    control_port: int = option(0, "the port workers register on (hello, heartbeats); 0 picks a free port")
    curve: str = option("auto", "CurveZMQ encryption of the internal sockets: on, off, or auto (on when the "
                                "secret comes from --secret-file or a socket binds beyond loopback)")
    zmq_curve: bool = option(False, "encrypt the client ZeroMQ socket with CurveZMQ; clients pass the printed "
                                    "server key (Client(server_key=...))")
    ssl_keyfile: str = option("", "serve HTTP over TLS: the private key file (PEM), with --ssl-certfile")
    ssl_certfile: str = option("", "serve HTTP over TLS: the certificate chain file (PEM), with --ssl-keyfile")
    ssl_ca_certs: str = option("", "with TLS: CA certificates (PEM); clients must then present a certificate "
                                   "one of them signed (mutual TLS)")
    routing: str = option("prefix_load", f"how a request's workers are chosen: {', '.join(POLICIES)}")
    # conditional disaggregation (router/core/disagg_policy.py, docs/slo.md)
    disagg: str = option("always", f"which prompts go via a prefill worker ({', '.join(DISAGG_MODES)}); the rest "
                                   "are prefilled on their decode worker")
    disagg_threshold_tokens: int = option(256, "threshold mode: via a prefill worker when the decode worker lacks "
                                               "at least this many of the prompt's tokens")
    disagg_max_prefill_queue: int = option(0, "threshold mode: prefill on the decode worker when the prefill worker "
                                              "has more prompt tokens than this queued (0: no limit)")
    disagg_latency_model: str = option("", "cost mode: the latency model file that `pdserve profile` wrote")
    disagg_tpot_guard_ms: float = option(0.0, "cost mode: via a prefill worker whenever a step of the decode worker "
                                              "that prefills the prompt would last longer than this (0: no guard)")
    # the SLO planner (router/planner/rule.py, docs/slo.md "Planner")
    planner: str = option("none", "'slo': watch TTFT/TPOT attainment, queues and KV use, and change the pools "
                                  "(role changes, new workers, core sharing) to meet the SLOs; 'none': never")
    slo_ttft_ms: float = option(0.0, "planner: the time-to-first-token SLO (ms)")
    slo_tpot_ms: float = option(0.0, "planner: the time-per-output-token SLO (ms)")
    planner_interval_s: float = option(3.0, "planner: the window (s): one decision per window")
    planner_max_workers: int = option(0, "planner: workers it may grow the deployment to (0: role changes only)")
    planner_target: float = option(0.9, "planner: the share of a window's requests that must meet each SLO")
    planner_sustain: int = option(2, "planner: consecutive windows a condition must hold before a change")
    planner_cooldown_s: float = option(15.0, "planner: no change this soon (s) after the last")
    planner_host_cores: int = option(0, "planner: one host's cores the workers share; with it the planner also "
                                        "trades one colocated worker on all of them for 1P+1D on half each "
                                        "(0: it does not plan core sharing)")
    planner_min_requests: int = option(10, "planner: judge attainment on at least this many of the latest finished "
                                           "requests (those sent since the pools last changed) where a window "
                                           "holds fewer; one host: a layout's measured score counts once it is "
                                           "over this many")
    planner_miss_z: float = option(1.28, "planner: a window misses an SLO's target only where the upper end of its "
                                        "attainment's Wilson interval at this z is below it, so that one late "
                                        "request among few does not start a change (0: the share itself; 1.28 won the "
                                        "planner's tuning, docs/slo.md)")
    planner_latency_models: str = option("", "planner, one host: latency model files (`pdserve profile`) of a worker "
                                             "on all --planner-host-cores threads and on half of them, "
                                             "comma-separated; the latest requests are simulated on both layouts "
                                             "and no split or merge predicted to do worse is made while the other "
                                             "layout's measured score is not remembered; auto: `serve` profiles "
                                             "its engine on this host at start-up (cached per model, engine and "
                                             "machine)")
    planner_memory_s: float = option(1800.0, "planner, one host: the longest (s) the observed attainment of a "
                                             "layout tried (colocated or split) is trusted to choose between them")
    planner_load_band: float = option(1.5, "planner, one host: a layout's observed attainment is trusted only "
                                           "while the load (request rate, mean prompt and output length) stays "
                                           "within this factor of the one it was measured under")
    max_model_len: int = 2048
    block_size: int = CacheConfig.block_size  # the workers' (the engine's default): prefix hashes are per block
    stale_after_s: float = option(5.0, "a worker silent this long (s) is dead")
    suspect_after_s: float = option(1.5, "a worker silent this long (s) gets no new requests until it is heard "
                                         "again (at most --stale-after; ~3 heartbeats)")
    worker_wait_s: float = option(10.0, "a request no live worker can serve waits this long (s) for one to "
                                        "register, then is refused (HTTP 503 + Retry-After); 0: refused at once")
    seed: int = 0
    enable_http: bool = True
    # admission: requests being prepared or in flight (queued on a worker included);
    # above it a new one is refused (HTTP 429 + Retry-After, ZeroMQ error "overloaded")
    max_inflight: int = 256
    retry_after_s: int = 1
    max_prompt_chars: int = option(0, "prompt size in characters, checked before tokenizing "
                                      "(0: max(65536, 16 x max-model-len))")
    max_body_bytes: int = option(16 * 1024 * 1024, "HTTP request body limit, however it is sent (chunked too)")
    api_key: str | None = None  # HTTP: required as "Authorization: Bearer <key>" on /v1/*
    tokenizer_threads: int = 2  # chat template + tokenization run here, off the event loop
    # fault tolerance (docs/reliability.md)
    retries: int = option(2, "re-route a request whose worker failed this many times")
    restart_workers: bool = False  # the launcher starts a worker again when it exits
    client_timeout_s: float = option(10.0, "a heartbeating ZeroMQ client silent this long (s) is gone: "
                                           "its requests are aborted")
    # chat output parsing over HTTP, vLLM's flags (router/openai/tools.py, router/parsers/reasoning.py)
    enable_auto_tool_choice: bool = option(False, 'serve tool_choice "auto": the model writes its calls, '
                                                  "--tool-call-parser reads them")
    tool_call_parser: str | None = option(None, f"the model's tool-call format: {', '.join(TOOL_CALL_PARSERS)}")
    reasoning_parser: str | None = option(None, f"split <think> reasoning into reasoning_content: "
                                                f"{', '.join(REASONING_PARSERS)}")

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be the deployment's resolved engine dtype (float32, bfloat16 or float16), "
                              f"got {self.dtype!r}")
        if self.curve not in CURVE_MODES:
            raise ConfigError(f"curve must be one of {', '.join(CURVE_MODES)}, got {self.curve!r}")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ConfigError("HTTP over TLS needs both ssl_keyfile and ssl_certfile (--ssl-keyfile, --ssl-certfile)")
        if self.ssl_ca_certs and not self.ssl_certfile:
            raise ConfigError("ssl_ca_certs (--ssl-ca-certs) needs TLS on: give --ssl-keyfile and --ssl-certfile")
        if self.routing not in POLICIES:
            raise ConfigError(f"routing {self.routing!r} is not one of {', '.join(POLICIES)}")
        if self.disagg not in DISAGG_MODES:
            raise ConfigError(f"disagg {self.disagg!r} is not one of {', '.join(DISAGG_MODES)}")
        if self.disagg == "cost" and not self.disagg_latency_model:
            raise ConfigError("disagg cost needs disagg_latency_model (a file from `pdserve profile`)")
        if min(self.disagg_threshold_tokens, self.disagg_max_prefill_queue, self.disagg_tpot_guard_ms) < 0:
            raise ConfigError("disagg_threshold_tokens, disagg_max_prefill_queue and disagg_tpot_guard_ms must be >= 0")
        self._check_planner()
        if self.retries < 0:
            raise ConfigError(f"retries must be >= 0, got {self.retries}")
        if not self.stale_after_s > 0 or not self.client_timeout_s > 0 or not self.suspect_after_s > 0:
            raise ConfigError("stale_after_s, suspect_after_s and client_timeout_s must be > 0 seconds")
        if not 0 <= self.worker_wait_s <= MAX_WORKER_WAIT_S:
            raise ConfigError(f"worker_wait_s must be in [0, {MAX_WORKER_WAIT_S:g}] seconds, got {self.worker_wait_s}")
        for name in ("http_port", "zmq_port", "control_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} must be a port number, got {getattr(self, name)}")
        for name in ("max_inflight", "retry_after_s", "max_body_bytes", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars < 0:
            raise ConfigError(f"max_prompt_chars must be >= 0 (0: default), got {self.max_prompt_chars}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser {self.tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser {self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it out to serve without one)")

    def _check_planner(self) -> None:
        if self.planner not in PLANNERS:
            raise ConfigError(f"planner {self.planner!r} is not one of {', '.join(PLANNERS)}")
        if self.planner == "slo" and not (self.slo_ttft_ms > 0 and self.slo_tpot_ms > 0):
            raise ConfigError("planner slo needs slo_ttft_ms and slo_tpot_ms > 0 (--slo-ttft-ms, --slo-tpot-ms)")
        if not self.planner_interval_s > 0 or self.planner_cooldown_s < 0 or self.planner_sustain < 1:
            raise ConfigError("planner_interval_s must be > 0, planner_cooldown_s >= 0, planner_sustain >= 1")
        if min(self.planner_max_workers, self.planner_host_cores, self.planner_memory_s) < 0 \
                or not 0 < self.planner_target <= 1 or self.planner_min_requests < 1:
            raise ConfigError("planner_max_workers, planner_host_cores and planner_memory_s must be >= 0, "
                              "planner_target in (0, 1], planner_min_requests >= 1")
        if not self.planner_miss_z >= 0:
            raise ConfigError(f"planner_miss_z must be >= 0, got {self.planner_miss_z}")
        if not self.planner_load_band >= 1:
            raise ConfigError(f"planner_load_band must be >= 1, got {self.planner_load_band}")
        if self.planner_latency_models and self.planner_host_cores < 2:
            raise ConfigError("planner_latency_models price the one-host layouts: give planner_host_cores >= 2")

    @property
    def prompt_chars_limit(self) -> int:
        return self.max_prompt_chars or default_prompt_chars(self.max_model_len)

    def zmq_address(self) -> str:
        return f"tcp://{self.host}:{self.zmq_port}"

    def control_address(self) -> str:
        return f"tcp://{self.host}:{self.control_port}"


def default_prompt_chars(max_model_len: int) -> int:
    """16 characters per token of context (a token averages ~4), at least 64 Ki: generous
    for any prompt that can fit, while bounding tokenization to ~0.1 s per request."""
    return max(64 * 1024, 16 * max_model_len)
