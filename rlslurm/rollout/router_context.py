"""The driver's `GenerateContext`: one `/generate` call through the router, bounded and retried.

Every sample is its own request (the router balances requests, it does not split a batch).
`max_concurrency` bounds the requests in flight from this driver, so a rollout of thousands
of samples does not open thousands of sockets or overfill the engines' queues.

A request that fails for a reason that can pass (no response, a 5xx from the router while
a worker is being replaced, 429) is sent again after an exponential backoff; a 4xx is a
bad request and fails at once, naming the URL. An *aborted* generation (a weight update
paused the engines in abort mode) is not an error: it comes back with finish_reason
"abort" and the collector hands its prompt back.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rlslurm.engines.sglang_client import SGLangClient, SGLangError
from rlslurm.errors import DataError
from rlslurm.rollout.generate_api import GenerateOutput

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# SGLang's default before anyone sets a version (`--weight-version default`).
INITIAL_VERSION_NAMES = frozenset({"default", ""})


def parse_weight_version(value: Any, *, where: str) -> int:
    """rlslurm's versions are integers (N = weights after training rollouts 0..N-1); an
    engine launched without `--weight-version 0` reports 'default', which is version 0."""
    text = str(value).strip()
    if text in INITIAL_VERSION_NAMES:
        return 0
    if text.isdigit():
        return int(text)
    raise DataError(where, f"engine weight_version {text!r} is not an integer: something other than rlslurm "
                           "updated the weights (rlslurm sets versions as plain integers)")


def is_retryable(e: SGLangError) -> bool:
    return e.status is None or e.status in RETRY_STATUSES


@dataclass
class RetryPolicy:
    # ~1 min of expected waiting in all: longer than a CPU engine's restart, so a node with
    # one engine rides out its restart instead of failing the rollout
    max_attempts: int = 10
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # While the node's supervisor restarts the router or an engine (`recovering`), failures do not use
    # up the tries, up to this long after the first: a router restarted on a loaded node took ~1 min
    # to answer, longer than the tries, and the rollout's failure cost an attempt (bench/results/chaos.md)
    recovery_wait_s: float = 600.0

    def delay(self, attempt: int) -> float:
        """Full jitter: many requests failing together (a dead worker) do not retry in lockstep."""
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2 ** attempt))


@dataclass
class CallStats:
    requests: int = 0
    retries: int = 0
    aborted: int = 0
    output_tokens: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> dict[str, float]:
        return {"rollout/engine/requests": float(self.requests), "rollout/engine/retries": float(self.retries),
                "rollout/engine/aborted": float(self.aborted),
                "rollout/engine/output_tokens": float(self.output_tokens)}


class RouterContext:
    """`GenerateContext` over an `SGLangClient` pointed at the router (or at one engine)."""

    def __init__(self, client: SGLangClient, tokenizer: Any, *, max_concurrency: int = 256,
                 retry: RetryPolicy | None = None, recovering: Callable[[], bool] | None = None):
        """`recovering`: is a restart of the router or an engine under way (engines/supervisor.py)."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.client = client
        self.tokenizer = tokenizer
        self.retry = retry or RetryPolicy()
        self.recovering = recovering or (lambda: False)
        self.stats = CallStats()
        self._slots = asyncio.Semaphore(max_concurrency)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> GenerateOutput:
        async with self._slots:
            out = await self._with_retries(input_ids, sampling_params)
        return self._parse(out)

    async def _with_retries(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Any:
        attempt, first_failure = 0, None
        while True:
            self.stats.requests += 1
            try:
                return await self.client.generate(input_ids, sampling_params, return_logprob=True)
            except SGLangError as e:
                attempt += 1
                first_failure = first_failure or time.monotonic()
                if not is_retryable(e):
                    raise
                if attempt >= self.retry.max_attempts:
                    if not self.recovering() or time.monotonic() - first_failure > self.retry.recovery_wait_s:
                        raise
                    attempt -= 1  # the supervisor is restarting what failed: wait for it
                    log.warning("generate failed (%s) while the router or an engine restarts: waiting for it", e)
                key = "no response" if e.status is None else str(e.status)
                self.stats.failures[key] = self.stats.failures.get(key, 0) + 1
                self.stats.retries += 1
                delay = self.retry.delay(attempt - 1)
                log.warning("generate failed (%s); retry %d/%d in %.1f s", e, attempt, self.retry.max_attempts - 1,
                            delay)
                await asyncio.sleep(delay)

    def _parse(self, out: Any) -> GenerateOutput:
        where = f"{self.client.base_url}/generate reply"
        if not isinstance(out, dict) or "meta_info" not in out:
            raise DataError(where, f"expected an object with meta_info, got {type(out).__name__}")
        meta = out["meta_info"]
        ids = [int(t) for t in out.get("output_ids") or []]
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(ids):
            raise DataError(where, f"{len(ids)} output ids but {len(entries)} output_token_logprobs "
                                   "(was return_logprob dropped on the way?)")
        finish = meta.get("finish_reason")
        # None: the request ended without a reason, which SGLang only does when it was cut off
        reason = "abort" if finish is None else str(finish.get("type") if isinstance(finish, dict) else finish)
        if reason == "abort":
            self.stats.aborted += 1
        self.stats.output_tokens += len(ids)
        return GenerateOutput(output_ids=ids, output_logprobs=[float(e[0]) for e in entries], finish_reason=reason,
                              weight_version=parse_weight_version(meta.get("weight_version", "default"), where=where))
