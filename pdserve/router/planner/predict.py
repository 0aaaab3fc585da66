"""What the SLO planner's two one-host layouts would do with the latest requests, before
it tries one: each layout -- one colocated worker on all `host_cores` threads, or 1P+1D
on half of them each -- serves the requests again in the simulator (router/simulate: the
router's own routing, the engine's scheduler and block manager on a virtual clock),
priced by the latency model `pdserve profile` measured for that layout's threads per
worker. A request is replayed at its send time with its prompt and output lengths
(distinct prompts: no prefix hits). The score is the planner's (router/planner/rule.py
`score`): the lower of the simulated TTFT and TPOT attainments.

`pdserve serve --planner slo --planner-host-cores N --planner-latency-models A,B`: the rule
then makes no split or merge that the models predict to do worse than the present layout,
unless that layout's measured score is remembered (what was measured outranks what was
predicted)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import ConfigError, SchedulerConfig
from pdserve.router.core.config import RouterConfig
from pdserve.common.latency_model import LatencyModel
from pdserve.router.planner.rule import score, share

PREDICT_S = 60.0       # the requests finished this long before the window's end are replayed
MAX_REQUESTS = 50      # at most this many, the latest (a replay costs ~40 us of CPU per generated token)
REFRESH_S = 30.0       # a prediction serves this long before the loop replays again
DEFAULT_BLOCKS = 4096  # a worker's KV blocks where no heartbeat said


@dataclass(frozen=True)
class LayoutModels:
    """A latency model per layout: colocated (a worker on all the host's cores) and split
    (a prefill and a decode worker on half of them each)."""

    colocated: LatencyModel
    split: LatencyModel

    @staticmethod
    def load(paths: str, host_cores: int) -> LayoutModels:
        """Comma-separated model files; each one's `meta.num_threads` says whose it is.
        ConfigError unless there is exactly one for `host_cores` threads and one for half."""
        if host_cores < 2:
            raise ConfigError("planner latency models need --planner-host-cores >= 2 (the layouts they price)")
        want = {host_cores: "colocated", host_cores // 2: "split"}
        found: dict[str, LatencyModel] = {}
        for path in (p.strip() for p in paths.split(",") if p.strip()):
            model = LatencyModel.load(path)
            threads = model.meta.get("num_threads")
            layout = want.get(threads) if isinstance(threads, int) else None
            if layout is None:
                raise ConfigError(f"latency model {path!r}: meta.num_threads is {threads!r}; the planner needs one "
                                  f"profiled with {host_cores} threads (colocated) and one with {host_cores // 2} "
                                  f"(split): `pdserve profile --num-threads N`")
            if layout in found:
                raise ConfigError(f"two latency models for {threads} thread(s): give one per layout")
            found[layout] = model
        missing = [f"{t} thread(s) ({name})" for t, name in want.items() if name not in found]
        if missing:
            raise ConfigError(f"planner latency models: none profiled with {' or '.join(missing)}")
        return LayoutModels(found["colocated"], found["split"])


class Predictor:
    """Simulates the latest finished requests on both layouts (`scores`)."""

    def __init__(self, models: LayoutModels, config: RouterConfig, ttft_slo_s: float, tpot_slo_s: float,
                 host_cores: int) -> None:
        self.models, self.host_cores = models, host_cores
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.router_config = RouterConfig(model_dir="simulated", routing=config.routing, disagg=config.disagg,
                                          disagg_threshold_tokens=config.disagg_threshold_tokens,
                                          disagg_max_prefill_queue=config.disagg_max_prefill_queue,
                                          disagg_latency_model=config.disagg_latency_model,
                                          disagg_tpot_guard_ms=config.disagg_tpot_guard_ms, block_size=config.block_size, enable_http=False)

    def requests(self, finished: list[tuple], now: float) -> list[tuple[float, list[int], int]]:
        """(arrival s, prompt ids, output tokens) of the finished-log entries to replay:
        those finished within PREDICT_S of `now`, at most MAX_REQUESTS, by send time."""
        recent = [r for r in finished if len(r) >= 6 and r[0] > now - PREDICT_S and r[4] > 0][-MAX_REQUESTS:]
        recent.sort(key=lambda r: r[3])
        if not recent:
            return []
        t0 = recent[0][3]
        return [(r[3] - t0, [i + 1] * int(r[4]), max(1, int(r[5]))) for i, r in enumerate(recent)]

    def scores(self, finished: list[tuple], now: float, num_blocks: int = 0,
               host_cpu_per_token_s: float = 0.0) -> tuple[tuple[str, float], ...]:
        """((layout, predicted score), ...) for colocated and split; () with nothing to replay.
        `host_cpu_per_token_s`: the router's own CPU a streamed token (the planner measures
        it), which the steps on all the host's cores share (router/simulate/sim.py `host_share`)."""
        from pdserve.router.simulate.sim import Deployment, Simulation  # the engine's scheduler: only when asked
        requests = self.requests(finished, now)
        if not requests:
            return ()
        blocks = num_blocks or DEFAULT_BLOCKS
        out = []
        for layout, dep, model in (
                ("colocated", Deployment(0, 0, 1, blocks, SchedulerConfig(), self.host_cores, self.host_cores,
                                         host_cpu_per_token_s), self.models.colocated),
                ("split", Deployment(1, 1, 0, blocks, SchedulerConfig(), self.host_cores // 2, self.host_cores,
                                     host_cpu_per_token_s), self.models.split)):
            records = [r.record for r in Simulation(dep, model, self.router_config).run(requests)]
            ttft = [r.ttft for r in records if r.ttft is not None]
            tpot = [r.tpot for r in records if r.tpot is not None]
            value = score(share(ttft, self.ttft_slo_s), share(tpot, self.tpot_slo_s))
            if value is not None:
                out.append((layout, round(value, 3)))
        return tuple(out)
