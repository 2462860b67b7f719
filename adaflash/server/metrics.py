"""Prometheus metrics of the server, in a registry of its own (several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest, ProcessCollector

from adaflash.engine.runner import StepStats

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

# Tokens per target pass: 1 (nothing accepted) up to block size 16 + the bonus; drafts per pass: 0..15.
ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 17, 24, 32)
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 10, 12, 15, 16, 24, 32)


class ServerMetrics:
    def __init__(self, policy: str, method: str, max_batch: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)  # process_resident_memory_bytes: load tests check memory stays flat
        self.requests = Counter("adaflash_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("adaflash_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("adaflash_generation_tokens", "tokens generated for clients", registry=r)
        self.prompt_tokens_reused = Counter(
            "adaflash_prompt_tokens_reused", "prompt tokens not prefilled: the KV cache held their blocks from an "
            "earlier request (prefix sharing, exact where the target computes each position alone: --dtype int8)",
            registry=r)
        self.kv_blocks_held = Gauge("adaflash_kv_blocks_held", "KV cache blocks requests hold (a shared one once)",
                                    registry=r)
        self.kv_blocks_reserved = Gauge("adaflash_kv_blocks_reserved", "KV cache blocks admitted requests may come "
                                        "to hold (prompt + max_tokens): admission waits while the pool lacks them",
                                        registry=r)
        self.kv_blocks = Gauge("adaflash_kv_blocks", "KV cache blocks in the pool (--kv-memory)", registry=r)
        self.disconnects = Counter("adaflash_client_disconnects",
                                   "requests aborted because the client went away before they finished", registry=r)
        self.request_timeouts = Counter("adaflash_request_timeouts",
                                        "requests aborted by the per-request deadline (--request-timeout)", registry=r)
        self.shutdown_aborts = Counter("adaflash_shutdown_aborts",
                                       "requests aborted because a shutdown's drain time ran out", registry=r)
        self.hot_swaps = Counter("adaflash_hot_swaps", "published drafter versions swapped in (--watch-versions)",
                                 registry=r)
        self.hot_swap_refused = Counter("adaflash_hot_swap_refused",
                                        "published drafter versions refused (failed to load or do not fit the target); "
                                        "the incumbent keeps serving", registry=r)
        self.accept_length = Histogram("adaflash_accept_length",
                                       "tokens committed per target pass (accepted drafts + the target's own)",
                                       buckets=ACCEPT_BUCKETS, registry=r)
        self.verify_length = Histogram("adaflash_verify_length", "drafted tokens verified per target pass",
                                       buckets=DRAFT_BUCKETS, registry=r)
        self.running = Gauge("adaflash_running_requests", "requests in the running batch", registry=r)
        self.queue_depth = Gauge("adaflash_queue_depth", "requests waiting for a slot", registry=r)
        self.free_slots = Gauge("adaflash_free_slots", "unused batch slots", registry=r)
        Gauge("adaflash_batch_slots", "batch slots in all (--max-batch)", registry=r).set(max_batch)
        self.length_policy = Info("adaflash_length_policy", "the draft-length policy and decoding method in use",
                                  registry=r)
        self.set_length_policy(policy, method)
        self.free_slots.set(max_batch)
        self._reused_seen = 0

    def set_length_policy(self, policy: str, method: str) -> None:
        """The policy label; a hot swap may change the policy (the version watcher's observer calls this)."""
        self.length_policy.info({"policy": policy, "method": method})

    def observe_step(self, stats: StepStats) -> None:
        """The runner's observer (called on the engine thread; prometheus-client is thread-safe)."""
        self.running.set(stats.running)
        self.queue_depth.set(stats.waiting)
        self.free_slots.set(stats.free_slots)
        for n in stats.accept_lengths:
            self.accept_length.observe(n)
        for k in stats.draft_lengths:
            self.verify_length.observe(k)
        # The engine keeps a running total; a counter only goes up by the difference.
        if stats.kv is not None:
            self.kv_blocks.set(stats.kv["blocks"])
            self.kv_blocks_held.set(stats.kv["held"])
            self.kv_blocks_reserved.set(stats.kv["reserved"])
        reused = stats.prompt_tokens_reused - self._reused_seen
        if reused > 0:
            self.prompt_tokens_reused.inc(reused)
            self._reused_seen = stats.prompt_tokens_reused

    def observe_hot_swap(self, swapped: bool) -> None:
        """The version watcher's observer: one call per published version it swapped in or refused."""
        (self.hot_swaps if swapped else self.hot_swap_refused).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountRequests:
    """ASGI middleware: count every HTTP request by endpoint and final status (streams count when done)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what the client gets if the app fails before answering

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # Unknown paths share one label, so a scanner cannot blow up the label cardinality.
            path = next((e for e in ENDPOINTS if scope["path"] == e or scope["path"].startswith(e + "/")), "other")
            self.metrics.requests.labels(path, str(status)).inc()
