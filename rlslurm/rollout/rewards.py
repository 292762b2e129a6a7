"""Reward functions: built-ins (`exact`, `math`, `remote`; slime's rules in rule_rewards.py) and user plugins.

A reward is a float, or a dict of named floats of which `reward_key` is trained on.
Per-sample functions take one `RewardInput`; per-group functions (GRPO-style
comparisons, pairwise judges) take the whole group and return one reward per sample.
Either kind may be sync or async. `score_group` is the one entry the driver calls.

The built-in rule rewards never raise on model output: garbage scores 0.0. A user
plugin that raises or returns a non-number is an error naming the plugin, because
that is a bug to fix, not a sample to score.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import numbers
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rlslurm.errors import ConfigError, UserError
from rlslurm.plugins import load_callable

# the sample, the answer checks and the rules built on them; re-exported: the reward API's names
from rlslurm.rollout.answers import Reward, RewardInput, exact_reward, last_boxed, math_reward  # noqa: F401
from rlslurm.rollout.rule_rewards import RULES
from rlslurm.settings.rm_types import RM_REGISTRY, RM_TYPES, rm_type_error

log = logging.getLogger(__name__)

BUILTIN_REWARDS = RM_TYPES  # the names --rm-type accepts (rlslurm/settings/rm_types.py)


class RewardError(UserError):
    """A reward function failed or returned something that is not a reward; names it."""


# --------------------------------------------------------------------------- remote RM


class RemoteRM:
    """An HTTP reward model: POST {prompt, response, label, metadata} -> a reward.

    The server answers a number, `{"reward": x}`, or a dict of named numbers.
    Connection errors, timeouts, 429 and 5xx are retried with exponential backoff;
    other 4xx are the request's fault and fail at once.
    """

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, api_key: str | None = None, *,
                 backoff_s: float = 0.5, max_backoff_s: float = 10.0, max_connections: int = 64):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--rm-url {url!r}: must be an http:// or https:// URL")
        if retries < 0:
            raise ConfigError(f"RemoteRM: retries must be >= 0, got {retries}")
        if timeout <= 0:
            raise ConfigError(f"RemoteRM: timeout must be > 0 s, got {timeout}")
        self.url = url
        self.timeout = timeout
        self.retries = retries
        self.api_key = api_key
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._limits = httpx.Limits(max_connections=max_connections)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> httpx.AsyncClient:
        # One pooled client per event loop: a client must not outlive the loop it was made on.
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop or self._client.is_closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=self._limits, headers=headers)
            self._loop = loop
        return self._client

    async def __call__(self, item: RewardInput) -> Reward:
        payload = {"prompt": item.prompt, "response": item.response, "label": item.label, "metadata": item.metadata}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                await asyncio.sleep(delay * (0.5 + random.random()))  # jitter: don't stampede a recovering RM
            try:
                resp = await self._http().post(self.url, json=payload)
            except httpx.TransportError as e:  # connect/read errors and timeouts
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code >= 400:
                raise RewardError(f"--rm-url {self.url}: HTTP {resp.status_code} (not retried): {resp.text[:200]}")
            try:
                body = resp.json()
            except ValueError:
                raise RewardError(f"--rm-url {self.url}: response is not JSON: {resp.text[:200]!r}") from None
            return _parse_remote(body, self.url)
        raise RewardError(f"--rm-url {self.url}: failed after {self.retries + 1} attempts; last error: {last}")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _parse_remote(body: Any, url: str) -> Reward:
    if isinstance(body, dict) and set(body) == {"reward"}:
        body = body["reward"]
    if isinstance(body, (int, float)) and not isinstance(body, bool):
        return float(body)
    if isinstance(body, dict) and body and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in body.values()
    ):
        return {str(k): float(v) for k, v in body.items()}
    raise RewardError(f"--rm-url {url}: expected a number, {{'reward': x}} or a dict of numbers, got {str(body)[:200]}")


# --------------------------------------------------------------------------- plugin plumbing


def group_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a custom reward function as per-group: called with the group's list of inputs."""
    fn.group_reward = True  # type: ignore[attr-defined]
    return fn


@dataclass
class RewardFn:
    """A reward function ready to score: per-sample `fn(item)` or per-group `fn(items)`."""

    fn: Callable[..., Any]
    group: bool = False
    name: str = ""


@dataclass(frozen=True)
class RuleReward:
    """A built-in rule as a per-sample function. A module-level class (not a closure) so
    that it pickles into a process pool (see `reward_executor`).

    A record's metadata may pick another rule (`{"rm_type": "exact"}`), so one prompt
    file can mix math problems with short-answer questions.
    """

    name: str

    def __call__(self, item: RewardInput) -> Reward:
        rm_type = item.metadata.get("rm_type", self.name) if isinstance(item.metadata, dict) else self.name
        rules = RULES
        rule = rules.get(rm_type)
        if rule is None:
            raise RewardError(f"{item.where or 'prompt'}: metadata rm_type {rm_type!r} is not one of {sorted(rules)}")
        return rule(item)


def _builtin(name: str) -> RewardFn:
    return RewardFn(RuleReward(name), group=False, name=f"--rm-type {name}")


def reward_executor(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """A process pool for CPU-bound per-sample rewards (math-verify parses LaTeX with
    sympy at a few ms a sample): pass it to `score_group` to keep the driver's event loop
    free and use the rollout node's cores. Workers are spawned, not forked, because the
    driver has threads (HTTP clients) that a fork would copy mid-operation."""
    import multiprocessing

    return concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def load_reward_fn(spec: str, *, group: bool | None = None) -> RewardFn:
    """--custom-rm-path `module:function` or `file.py:function`.

    Per-group when `group` is true or the function is decorated with `@group_reward`
    (slime's --group-rm is refused with that advice, rlslurm/settings/slime_flags.py); per-sample otherwise.
    """
    fn = load_callable(spec, what="--custom-rm-path", min_args=1)
    is_group = bool(getattr(fn, "group_reward", False)) if group is None else group
    return RewardFn(fn, group=is_group, name=f"--custom-rm-path {spec}")


def build_reward_fn(rm_type: str | None = None, *, custom_rm_path: str | None = None, group_rm: bool | None = None,
                    rm_url: str | None = None, rm_timeout: float = 30.0, rm_retries: int = 3,
                    rm_api_key: str | None = None) -> RewardFn:
    """The reward function the flags ask for (a custom path wins over --rm-type)."""
    if custom_rm_path:
        return load_reward_fn(custom_rm_path, group=group_rm)
    if rm_type in RULES:
        return _builtin(rm_type)
    if rm_type in RM_REGISTRY and RM_REGISTRY[rm_type].needs_url:  # remote, or slime's remote_rm
        if not rm_url:
            raise ConfigError(f"--rm-type {rm_type} needs --rm-url")
        return RewardFn(RemoteRM(rm_url, rm_timeout, rm_retries, rm_api_key), group=False, name=f"--rm-url {rm_url}")
    raise ConfigError(f"--rm-type {rm_type!r}: {rm_type_error(str(rm_type)) or 'not a built-in rule'}")


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)) \
        or isinstance(fn, RemoteRM)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _as_number(v: Any) -> float | None:
    """A reward value as a float, or None. Rewards are often computed with numpy (np.float32 from a
    mean, np.bool_ from a comparison) or are plain bools (`answer == label`): all score as numbers."""
    if isinstance(v, numbers.Real):  # int, float, bool, numpy ints and floats
        return float(v)
    if type(v).__module__ == "numpy" and getattr(v, "shape", None) == () and v.dtype.kind in "biuf":
        return float(v)  # np.bool_ (not registered with `numbers`) and 0-d arrays
    return None


def check_reward(value: Any, *, reward_key: str | None, name: str, where: str) -> Reward:
    """Validate one reward: a finite number, or a dict of finite numbers holding reward_key."""
    ctx = f"{name} (sample {where})" if where else name
    num = _as_number(value)
    if num is not None:
        if not math.isfinite(num):
            raise RewardError(f"{ctx}: returned {value}")
        return num
    if isinstance(value, Mapping) and value:
        out: dict[str, float] = {}
        for k, v in value.items():
            num = _as_number(v)
            if num is None or not math.isfinite(num):
                raise RewardError(f"{ctx}: reward dict entry {k!r} is {v!r}, not a finite number")
            out[str(k)] = num
        if reward_key is None:
            raise RewardError(f"{ctx}: returned a dict {sorted(out)}; set --reward-key to pick the trained one")
        if reward_key not in out:
            raise RewardError(f"{ctx}: --reward-key {reward_key!r} not in the returned keys {sorted(out)}")
        return out
    raise RewardError(f"{ctx}: returned {type(value).__name__} {str(value)[:80]!r}, expected a number or dict")


async def score_group(items: Sequence[RewardInput], reward_fn: RewardFn | Callable[..., Any], *,
                      reward_key: str | None = None,
                      executor: concurrent.futures.Executor | None = None) -> list[Reward]:
    """Score one group's samples; returns one validated reward per item, in order.

    With `executor`, a sync per-sample function runs there (it must pickle for a
    process pool: a module-level function or `RuleReward`); async ones stay on the loop.
    """
    rf = reward_fn if isinstance(reward_fn, RewardFn) else RewardFn(
        reward_fn, group=bool(getattr(reward_fn, "group_reward", False)),
        name=getattr(reward_fn, "__name__", "reward function"))
    items = list(items)
    if not items:
        return []
    try:
        if rf.group:
            raw = await _maybe_await(rf.fn(items))
            if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or len(raw) != len(items):
                got = f"{len(raw)} rewards" if isinstance(raw, Sequence) else type(raw).__name__
                raise RewardError(f"{rf.name}: per-group reward must return one reward per sample "
                                  f"({len(items)}), got {got}")
        elif executor is not None and not _is_async(rf.fn):
            loop = asyncio.get_running_loop()
            raw = await asyncio.gather(*(loop.run_in_executor(executor, rf.fn, it) for it in items))
        else:
            raw = await asyncio.gather(*(_maybe_await(rf.fn(it)) for it in items))
    except RewardError:
        raise
    except Exception as e:
        where = items[0].where
        raise RewardError(f"{rf.name}: raised {type(e).__name__}: {e}" + (f" (prompt {where})" if where else "")) \
            from e
    return [check_reward(v, reward_key=reward_key, name=rf.name, where=it.where) for v, it in zip(raw, items)]


