"""/metrics: Prometheus metrics under vLLM's names (so vLLM dashboards work), plus the engine's slot and page use
under `flashnext:`.

Gauges are read from the engine when scraped; counters and histograms are fed per request by `ServerMetrics.track`.
Each app has its own registry (several apps in one test process must not share counters).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import jax
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_xla = {"started": 0, "finished": 0}


def _compile_started(event: str, **_kw) -> None:
    if event == "/jax/compilation_cache/compile_requests_use_cache":  # (recorded while the persistent cache is on)
        _xla["started"] += 1


def _compile_finished(event: str, _duration: float, **_kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":  # every executable built (or read from the cache)
        _xla["finished"] += 1


jax.monitoring.register_event_listener(_compile_started)
jax.monitoring.register_event_duration_secs_listener(_compile_finished)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)


class _EngineGauges:
    """Collector reading the engine's scheduler and store ledger at scrape time."""

    def __init__(self, llm, model_name: str):
        self.llm, self.labels = llm, {"model_name": model_name}

    def collect(self):
        engine = self.llm.engine
        use = engine.usage()

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), value)
            return g

        yield gauge("vllm:num_requests_running", "Requests in the running batch", len(engine.sched.running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", len(engine.sched.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full)",
                    use["pages_used"] / max(1, use["pages"]))
        yield gauge("flashnext:slots_used", "Per-request state slots in use", use["slots_used"])
        yield gauge("flashnext:slots_total", "Per-request state slots", use["slots"])
        yield gauge("flashnext:pages_used", "KV-cache pages in use", use["pages_used"])
        yield gauge("flashnext:pages_total", "KV-cache pages", use["pages"])
        yield gauge("flashnext:prefix_snapshots", "Prefix-cache snapshots held", use["snapshots"])
        # each compiled model step holds an executable (~1,000 memory maps at the real size): the soak test reads it
        steps, samplers = engine._steps, engine._samplers  # the engine's StepCaches (LRUs of compiled programs)
        yield gauge("flashnext:step_compilations", "Engine model steps compiled so far", steps.counters["compiled"])
        yield gauge("flashnext:compiled_steps_cached", "Compiled engine model steps held (LRU-bounded)", len(steps))
        yield gauge("flashnext:compiled_steps_evicted", "Compiled engine model steps dropped by the LRU",
                    steps.counters["evicted"])
        yield gauge("flashnext:sampler_compilations", "Engine samplers (device sampling, logprobs, logit bias, "
                    "grammar masks after a model step) compiled so far", samplers.counters["compiled"])
        yield gauge("flashnext:compiled_samplers_cached", "Compiled engine samplers held (LRU-bounded)", len(samplers))
        yield gauge("flashnext:compiled_samplers_evicted", "Compiled engine samplers dropped by the LRU",
                    samplers.counters["evicted"])
        yield gauge("flashnext:xla_compilations", "XLA executables this process built or loaded from the cache "
                    "(step programs and every other jitted function)", _xla["finished"])
        yield gauge("flashnext:xla_compilations_in_progress", "XLA compilations under way (counted while the "
                    "persistent compilation cache is on)", max(0, _xla["started"] - _xla["finished"]))


class ServerMetrics:
    def __init__(self, llm, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineGauges(llm, model_name))
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.model_name = model_name

        def counter(name, doc):
            return Counter(name, doc, **labels).labels(model_name)

        def histogram(name, doc):
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, **labels).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "MTP draft tokens proposed")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "MTP draft tokens accepted")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to the first generated token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between generated tokens")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish")
        self.finished = Counter("vllm:request_success", "Finished requests", ["model_name", "finished_reason"],
                                registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def track(self, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Pass a request's outputs through, recording its latencies and, when it finishes, its token counts."""
        start = last = time.monotonic()
        n_tokens = 0
        try:
            async for out in outputs:
                now = time.monotonic()
                new = len(out.token_ids) - n_tokens
                if new > 0:
                    if n_tokens == 0:
                        self.ttft.observe(now - start)
                    else:
                        for _ in range(new):
                            self.itl.observe((now - last) / new)
                    n_tokens, last = len(out.token_ids), now
                if out.finished:
                    self._finished(out, now - start)
                yield out
        finally:
            await outputs.aclose()

    def _finished(self, out, elapsed: float) -> None:
        m = out.metrics
        self.e2e.observe(elapsed)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.prefix_queries.inc(len(out.prompt_token_ids))
        self.prefix_hits.inc(m.get("num_cached_tokens", 0))
        self.draft_tokens.inc(m.get("num_drafts", 0))
        self.accepted_tokens.inc(m.get("num_accepted", 0))
        self.finished.labels(self.model_name, out.finish_reason or "unknown").inc()
