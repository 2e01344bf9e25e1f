"""`kvshard bench dcp`: the seed's experiment, TP alone against TP + DCP, in one command.

For each layout (tp alone, then tp with each requested dcp) a `kvshard serve`
starts with the same per-rank KV budget, all of them before the first point
(`--interleave`, the default on a CPU; one at a time where they would share
GPUs); the same requests (or sessions of requests, with the sessions workload)
run at rising client concurrency, the layouts taking turns point by point
(which goes first alternates), each point from an empty prefix cache; /metrics says how many requests the server
actually ran at once and how full its KV cache was. The table then gives, per
layout, the seed's columns: the maximum concurrency reached, output tok/s per
rank, KV usage, and what limits it. A point is *KV-limited* when the server
preempted requests, or requests waited while its KV cache was (nearly) full;
otherwise the server ran what it could take and compute (the step time) is the
limit. Each point also gives its output tok/s per rank while requests waited
(the server at its capacity, from the /metrics scrapes): a closed-loop point
ends with its last requests finishing and nothing left to admit, a ramp-down
that weighs more on the layout holding more requests at once, and this figure
leaves it out (the headline figure keeps it). Each point also gives the share of the server's step time that went to
steps computing prompt tokens (`prefilling`, from kvshard:engine_step_seconds):
DCP amortises a step's fixed cost over twice the decodes, but divides neither a
prompt's prefill nor its tokens' work, so a workload whose steps mostly prefill
gains little from it whatever the extra concurrency.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kvshard.bench.report import format_number, format_percent, format_table, write_json
from kvshard.bench.serve import (BenchmarkError, request_list_digest, reset_prefix_cache, run_serve_benchmark,
                                 sigterm_as_interrupt)
from kvshard.bench.server import ServerProcess
from kvshard.bench.traces import TraceReplay
from kvshard.bench.workloads import BenchRequest, WorkloadSpec, _fraction

KV_FULL = 0.9  # peak KV usage from which a held-back request counts as KV-limited
_POINT_FIELDS = ("duration_s", "completed", "failed", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "output_throughput", "total_token_throughput",
                 "output_throughput_per_rank", "total_token_throughput_per_rank",
                 "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                 "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "errors", "server", "num_sessions",
                 "total_cached_tokens", "cached_fraction", "turns")


@dataclass(frozen=True)
class DCPExperiment:
    model: str
    tp: int
    dcps: list[int]
    concurrencies: list[int]
    workload: WorkloadSpec | TraceReplay
    kv_cache_memory: str
    max_num_seqs: int
    server_flags: list[str] = field(default_factory=list)  # engine flags besides tp, dcp, KV and max-num-seqs
    prompts_per_concurrency: int = 2
    output_dir: Path = Path("bench-results")
    startup_timeout: float = 300.0
    metrics_interval: float = 0.25
    progress: bool = True
    # the sessions the points send from (each point its first concurrency x prompts_per_concurrency);
    # None: drawn from the workload spec
    sessions: list[list[BenchRequest]] | None = None
    sweep_limit: int = 0  # past the last concurrency, double up to this until the layout saturates
    # every layout's server up at once, the layouts taking turns point by point; False: one server at a time, each
    # layout's whole sweep after the other's (servers that cannot share the devices: a GPU's memory)
    interleave: bool = True

    def layouts(self) -> list[tuple[int, int]]:
        return [(self.tp, 1)] + [(self.tp, d) for d in self.dcps if d != 1]

    @property
    def workload_description(self) -> str:
        if isinstance(self.workload, TraceReplay):
            info = self.workload.info
            return (f"trace {Path(info['path']).name} (sha256 {info['sha256'][:12]}), "
                    f"{info['num_sessions']:,} {'conversations' if info['conversations'] else 'requests'} "
                    f"from request {info['skip'] + 1}, lengths x{_fraction(info['context_scale'])} "
                    f"(blocks of {info['block_tokens']}), outputs x{_fraction(info['output_scale'])}, closed loop")
        return self.workload.describe()

    def all_sessions(self) -> list[list[BenchRequest]]:
        if self.sessions is not None:
            return self.sessions
        top = max(max(self.concurrencies), self.sweep_limit)
        return self.workload.sessions(top * self.prompts_per_concurrency)


def saturated(points: list[dict]) -> bool:
    """The layout's KV cache reached its cap at the last point (preemptions, or a peak at KV_FULL) and its
    throughput per rank stopped rising (the last point at most 5% above the best before it)."""
    if len(points) < 2:
        return False
    last = points[-1]
    server = last["server"]
    kv_capped = server["preemptions"] > 0 or server["peak_kv_usage"] >= KV_FULL
    best_before = max(p["output_throughput_per_rank"] or 0.0 for p in points[:-1])
    return kv_capped and (last["output_throughput_per_rank"] or 0.0) <= 1.05 * best_before


def layout_label(tp: int, dcp: int) -> str:
    return f"TP={tp}" if dcp == 1 else f"TP={tp} + DCP={dcp}"


def limit_of(point: dict, max_num_seqs: int) -> str:
    """What held the server's batch back at this point.

    KV memory: it preempted, or requests waited while the KV cache was (nearly) full.
    max-num-seqs: requests waited with the batch at its configured size. Otherwise
    every request the server could take ran: compute (the step time) is the limit.
    """
    server = point["server"]
    if server["preemptions"] > 0 or (server["peak_waiting"] > 0 and server["peak_kv_usage"] >= KV_FULL):
        return "KV memory"
    if server["peak_waiting"] > 0 and server["peak_running"] >= max_num_seqs:
        return "max-num-seqs"
    return "compute"


def point_of(result: dict, concurrency: int, num_ranks: int, max_num_seqs: int) -> dict:
    """A sweep's point from its `bench serve` result: the figures the tables read."""
    point = {"concurrency": concurrency, "num_prompts": result["num_prompts"], **{k: result[k] for k in _POINT_FIELDS}}
    steps = point["server"]["engine_steps"]
    point["mean_step_ms"] = point["duration_s"] * 1000 / steps if steps else None
    saturated_rate = point["server"].get("saturated_output_throughput")
    point["saturated_output_throughput_per_rank"] = saturated_rate / num_ranks if saturated_rate else None
    point["limited_by"] = limit_of(point, max_num_seqs)
    return point


def summarize_config(points: list[dict]) -> dict:
    best = max(points, key=lambda p: p["output_throughput_per_rank"] or 0.0)
    top = points[-1]
    busiest = max(points, key=lambda p: p["server"]["peak_running"])
    waited = [p for p in points if p.get("saturated_output_throughput_per_rank")]
    saturated_best = max(waited, key=lambda p: p["saturated_output_throughput_per_rank"]) if waited else None
    return {
        "max_concurrency_reached": busiest["server"]["peak_running"],
        "max_concurrency_at": busiest["concurrency"],
        "max_mean_running": max(p["server"]["mean_running"] for p in points),
        "best_output_throughput_per_rank": best["output_throughput_per_rank"],
        "best_at_concurrency": best["concurrency"],
        "kv_usage_at_best": best["server"]["peak_kv_usage"],
        # the best point's throughput while requests waited (None where no point kept requests waiting long enough)
        "best_saturated_output_throughput_per_rank":
            saturated_best["saturated_output_throughput_per_rank"] if saturated_best else None,
        "best_saturated_at_concurrency": saturated_best["concurrency"] if saturated_best else None,
        "limited_by": top["limited_by"],
        "peak_waiting_at_top": top["server"]["peak_waiting"],
        "preemptions_at_top": top["server"]["preemptions"],
    }


class _Sweep:
    """One layout's server and its sweep of concurrencies, a point at a time."""

    def __init__(self, experiment: DCPExperiment, tp: int, dcp: int) -> None:
        self.experiment, self.tp, self.dcp = experiment, tp, dcp
        self.label = layout_label(tp, dcp)
        self.flags = ["--tensor-parallel-size", str(tp), "--dcp", str(dcp),
                      "--kv-cache-memory", experiment.kv_cache_memory,
                      "--max-num-seqs", str(experiment.max_num_seqs), *experiment.server_flags]
        self.server = ServerProcess(experiment.model, self.flags,
                                    experiment.output_dir / f"server-tp{tp}-dcp{dcp}.log", experiment.startup_timeout)
        self.concurrencies = list(experiment.concurrencies)
        self.points: list[dict] = []
        self.sweep_end: str | None = None

    @property
    def done(self) -> bool:
        return not self.concurrencies

    def run_next(self, sessions: list[list[BenchRequest]], log) -> None:
        experiment, label = self.experiment, self.label
        concurrency = self.concurrencies.pop(0)
        wanted = concurrency * experiment.prompts_per_concurrency
        if wanted > len(sessions):
            self.sweep_end = f"the workload has {len(sessions)} sessions, fewer than c={concurrency} needs ({wanted})"
            log(f"   {label} c={concurrency}: skipped, {self.sweep_end}")
            self.concurrencies.clear()
            return
        # each point replays the first sessions of the last: it must not find them cached
        reset_prefix_cache(self.server.base_url)
        result = run_serve_benchmark(self.server.base_url, sessions[:wanted], max_concurrency=concurrency,
                                     num_ranks=self.tp, metrics_interval=experiment.metrics_interval,
                                     progress=experiment.progress, label=f"{label} c={concurrency}")
        point = point_of(result, concurrency, self.tp, experiment.max_num_seqs)
        self.points.append(point)
        s = point["server"]
        log(f"   {label} c={concurrency:<4} running peak {s['peak_running']:>3} (mean {s['mean_running']:.1f}), "
            f"waiting peak {s['peak_waiting']:>3}, KV peak {s['peak_kv_usage']:.0%}, "
            f"preemptions {s['preemptions']}, "
            f"cached {format_percent(point['cached_fraction'], 0)} of prompt tokens, "
            f"step time prefilling {format_percent(s.get('prefill_step_share'), 0)}, "
            f"{point['output_throughput_per_rank']:.1f} out tok/s/rank "
            f"({format_number(point['saturated_output_throughput_per_rank'], 1)} while requests waited)"
            + (f", {point['failed']} FAILED: {point['errors'][0]}" if point["failed"] else ""))
        if self.concurrencies:
            return
        if saturated(self.points):
            self.sweep_end = f"saturated at c={concurrency}"
        elif concurrency * 2 > experiment.sweep_limit:
            self.sweep_end = f"not saturated: the sweep stopped at c={concurrency} (--sweep-limit {experiment.sweep_limit})"
        else:
            self.concurrencies.append(concurrency * 2)

    def summary(self, log) -> dict:
        if not self.points:
            raise BenchmarkError(f"{self.label}: no point of the sweep could run: {self.sweep_end}")
        if self.sweep_end is None:
            self.sweep_end = f"the sweep ended at c={self.points[-1]['concurrency']}"
        log(f"   {self.label}: {self.sweep_end}")
        return {"label": self.label, "tp": self.tp, "dcp": self.dcp, "base_url": self.server.base_url,
                "layout": self.points[0]["server"]["layout"], "server_log": str(self.server.log_path),
                "points": self.points, "sweep_end": self.sweep_end, "saturated": saturated(self.points),
                **summarize_config(self.points)}


def run_dcp_experiment(experiment: DCPExperiment, log=print) -> dict:
    """With `interleave`, every layout's server is started first; then the layouts take turns point by point (the
    one that goes first alternates), so that a machine whose speed drifts over the minutes of a sweep weighs on
    every layout alike: run one layout's whole sweep after another's, the 2-core VMs of BENCHMARKS.md moved a
    layout's tok/s by up to 20% between them. An idle server's ranks nap (kvshard/shm.py) while another's point
    runs. Without it, one server at a time (each holds the devices' memory: GPUs)."""
    # with the sessions workload, concurrency and prompts per concurrency count sessions
    sessions = experiment.all_sessions()
    sweeps = [_Sweep(experiment, tp, dcp) for tp, dcp in experiment.layouts()]
    try:
        configs = _run_sweeps(experiment, sweeps, sessions, log)
    except BaseException:  # Ctrl-C, a server that died: the servers are stopped by now; the points must outlive them
        _save_interrupted(experiment, sweeps, log)
        raise
    baseline = configs[0]
    for config in configs[1:]:
        config["vs_tp_only"] = {
            "max_concurrency": _ratio(config["max_concurrency_reached"], baseline["max_concurrency_reached"]),
            "max_mean_running": _ratio(config["max_mean_running"], baseline["max_mean_running"]),
            "output_throughput_per_rank": _ratio(config["best_output_throughput_per_rank"],
                                                 baseline["best_output_throughput_per_rank"]),
            "saturated_output_throughput_per_rank": _ratio(config["best_saturated_output_throughput_per_rank"],
                                                           baseline["best_saturated_output_throughput_per_rank"]),
        }
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": experiment.model,
        "kv_cache_memory": experiment.kv_cache_memory,
        "max_num_seqs": experiment.max_num_seqs,
        "server_flags": experiment.server_flags,
        "workload": experiment.workload_description,
        **({"trace": {k: v for k, v in experiment.workload.info.items()}}
           if isinstance(experiment.workload, TraceReplay) else {"workload_spec": asdict(experiment.workload)}),
        "concurrencies": sorted({p["concurrency"] for c in configs for p in c["points"]}),
        "sweep_limit": experiment.sweep_limit,
        "prompts_per_concurrency": experiment.prompts_per_concurrency,
        "requests_digest": request_list_digest([turn for session in sessions for turn in session]),
        "configs": configs,
    }


def _run_sweeps(experiment: DCPExperiment, sweeps: list[_Sweep], sessions: list[list[BenchRequest]],
                log) -> list[dict]:
    """Every layout's sweep, interleaved or one after another; each layout's summary."""
    with sigterm_as_interrupt():  # SIGTERM unwinds like Ctrl-C: the servers are stopped either way
        if experiment.interleave:
            with ExitStack() as servers:
                for sweep in sweeps:
                    log(f"== {sweep.label}: kvshard serve {experiment.model} {' '.join(sweep.flags)}")
                    servers.enter_context(sweep.server)
                turn = 0
                while not all(sweep.done for sweep in sweeps):
                    order = [sweep for sweep in sweeps if not sweep.done]
                    for sweep in (order if turn % 2 == 0 else order[::-1]):
                        sweep.run_next(sessions, log)
                    turn += 1
                configs = [sweep.summary(log) for sweep in sweeps]
        else:
            configs = []
            for sweep in sweeps:
                log(f"== {sweep.label}: kvshard serve {experiment.model} {' '.join(sweep.flags)}")
                with sweep.server:
                    while not sweep.done:
                        sweep.run_next(sessions, log)
                    configs.append(sweep.summary(log))
    return configs


def _save_interrupted(experiment: DCPExperiment, sweeps: list[_Sweep], log) -> None:
    """The points measured before the experiment stopped early, in dcp-interrupted.json."""
    measured = [{"label": sweep.label, "tp": sweep.tp, "dcp": sweep.dcp, "points": sweep.points}
                for sweep in sweeps if sweep.points]
    if not measured:
        return
    path = experiment.output_dir / "dcp-interrupted.json"
    try:
        write_json(path, {"interrupted": True, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          "model": experiment.model, "kv_cache_memory": experiment.kv_cache_memory,
                          "workload": experiment.workload_description, "configs": measured})
    except OSError as error:
        log(f"stopped early: the points measured could not be saved to {path}: {error.strerror or error}")
        return
    log(f"stopped early: the {sum(len(c['points']) for c in measured)} points measured so far are in {path}")


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value and base else None


def format_dcp_table(result: dict) -> str:
    """The seed's table, one row per layout, then the ratios against TP alone."""
    rows = []
    for c in result["configs"]:
        layout = c["layout"]
        capacity = f"{int(layout['kv_capacity_tokens']):,}" if layout.get("kv_capacity_tokens") else "?"
        limit = c["limited_by"]
        if limit == "KV memory":
            limit += f" (waiting {c['peak_waiting_at_top']}, {c['preemptions_at_top']} preemptions)"
        rows.append([c["label"], capacity,
                     f"{c['max_concurrency_reached']} (c={c.get('max_concurrency_at', '?')})",
                     f"{c['max_mean_running']:.1f}",
                     f"{c['best_output_throughput_per_rank']:.1f} (c={c['best_at_concurrency']})",
                     _saturated_cell(c), f"{c['kv_usage_at_best']:.0%}", limit, c.get("sweep_end", "")])
    lines = [format_table(["configuration", "KV capacity (tokens)", "max concurrency", "mean running",
                           "out tok/s per rank", "while requests waited", "KV usage", "limited by", "sweep"], rows),
             "max concurrency: peak of kvshard:num_requests_running over the sweep; mean running: its time "
             "average at the busiest point; out tok/s per rank: the best point; while requests waited: out tok/s "
             "per rank over the stretches with requests waiting, at the point where it is best (the server at its capacity, "
             "without the point's ramp-down); (c=...): the point each figure comes from; limited by: at the last "
             "point; sweep: why the sweep stopped there"]
    for c in result["configs"][1:]:
        ratio = c["vs_tp_only"]
        lines.append(f"{c['label']} vs {result['configs'][0]['label']}: max concurrency "
                     f"{_times(ratio['max_concurrency'])} (mean running {_times(ratio['max_mean_running'])}), "
                     f"out tok/s per rank {_times(ratio['output_throughput_per_rank'])} "
                     f"(while requests waited {_times(ratio.get('saturated_output_throughput_per_rank'))})")
    return "\n".join(lines)


def _saturated_cell(config: dict) -> str:
    rate = config.get("best_saturated_output_throughput_per_rank")
    return "n/a" if rate is None else f"{rate:.1f} (c={config['best_saturated_at_concurrency']})"


def format_points_table(result: dict) -> str:
    """Every point of the sweep."""
    rows = []
    for c in result["configs"]:
        for p in c["points"]:
            s = p["server"]
            rows.append([c["label"], str(p["concurrency"]), f"{s['peak_running']} / {s['mean_running']:.1f}",
                         str(s["peak_waiting"]), f"{s['peak_kv_usage']:.0%}", str(s["preemptions"]),
                         format_percent(p["cached_fraction"], 0),
                         f"{p['output_throughput_per_rank']:.1f}",
                         format_number(p.get("saturated_output_throughput_per_rank"), 1), f"{p['median_ttft_ms']:,.0f}",
                         f"{p['median_tpot_ms']:,.0f}", format_number(p.get("mean_step_ms"), 0),
                         format_percent(s.get("prefill_step_share"), 0), f"{p['duration_s']:.1f}", p["limited_by"]])
    return format_table(["configuration", "concurrency", "running peak/mean", "waiting peak", "KV peak",
                         "preempt", "cached", "out tok/s/rank", "tok/s/rank while waiting", "TTFT p50 ms", "TPOT p50 ms", "ms/step", "prefilling",
                         "time s", "limited by"], rows)


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
