"""A small async HTTP client for one SGLang server (or the router, which speaks the same
`/generate` and `/flush_cache`), with the job's api key on every request.

Every call has an explicit timeout, and every failure raises `SGLangError` naming the URL and
the HTTP status (None when the server could not be reached or did not answer in time), so a
caller never has to parse httpx exceptions. Endpoint bodies follow SGLang 0.5.23
(docs/sglang-behaviour.md, "HTTP API contract").
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import httpx

from rlslurm.engines.sglang_versions import DEFAULT as DEFAULT_API, SGLangAPI

DEFAULT_TIMEOUT_S = 30.0
GENERATE_TIMEOUT_S = 600.0
# A weight update blocks until every rank of the group has received every tensor.
WEIGHT_UPDATE_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 5.0
# Engines and the router are on the cluster network: an http(s)_proxy set for the outside
# world (common on login/compute nodes) must not capture these calls.
TRUST_ENV = False


class SGLangError(RuntimeError):
    """A request to an SGLang server or the router failed. `status` is None for transport
    errors (connection refused, reset, timeout)."""

    def __init__(self, url: str, status: int | None, message: str):
        self.url = url
        self.status = status
        self.message = message
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{url}: {where}: {message}")


class SGLangTimeout(SGLangError):
    def __init__(self, url: str, timeout: float):
        super().__init__(url, None, f"timed out after {timeout:g} s")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def health_sync(base_url: str, *, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """GET /health (open without the key on SGLang): True on 200, False otherwise or unreachable.
    Synchronous, for the supervisor's health thread."""
    try:
        return httpx.get(f"{base_url}/health", timeout=timeout, trust_env=TRUST_ENV).status_code == 200
    except httpx.HTTPError:
        return False


def weight_version_sync(base_url: str, api_key: str | None, *, timeout: float = HEALTH_TIMEOUT_S) -> str:
    """`SGLangClient.get_weight_version` from synchronous code with no event loop (the supervisor's
    health thread); the same errors."""
    async def get() -> str:
        async with SGLangClient(base_url, api_key) as c:
            return await c.get_weight_version(timeout=timeout)

    return asyncio.run(get())


class SGLangClient:
    """Async client for `base_url` (e.g. `http://10.0.0.5:30000`). Use as an async context
    manager, or call `aclose()`."""

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 http: httpx.AsyncClient | None = None, api: SGLangAPI = DEFAULT_API):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.api = api  # the server's SGLang version: which endpoints exist (sglang_versions.py)
        self._own_http = http is None
        # Rollouts send hundreds of concurrent single requests (the router does not split batches).
        self._http = http or httpx.AsyncClient(
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=512),
            timeout=DEFAULT_TIMEOUT_S,
            trust_env=TRUST_ENV,
        )

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()

    # --- plumbing -------------------------------------------------------------------------
    async def _request(self, method: str, path: str, *, json: Any = None, timeout: float) -> httpx.Response:
        url = self.base_url + path
        try:
            r = await self._http.request(method, url, json=json, headers=auth_headers(self.api_key),
                                         timeout=timeout)
        except httpx.TimeoutException:
            raise SGLangTimeout(url, timeout) from None
        except httpx.HTTPError as e:
            raise SGLangError(url, None, f"{type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise SGLangError(url, r.status_code, _error_text(r))
        return r

    async def _json(self, method: str, path: str, *, json: Any = None, timeout: float) -> Any:
        r = await self._request(method, path, json=json, timeout=timeout)
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text

    async def _checked(self, path: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """POST to an endpoint that answers {"success": bool, "message": str}; success=false raises."""
        out = await self._json("POST", path, json=body, timeout=timeout)
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(self.base_url + path, 200, str(out.get("message", out)))
        return out if isinstance(out, dict) else {"result": out}

    # --- generation -----------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]], sampling_params: dict[str, Any],
                       *, return_logprob: bool = True, logprob_start_len: int | None = None,
                       rid: str | None = None, timeout: float = GENERATE_TIMEOUT_S) -> Any:
        """POST /generate with token ids. Returns the server's JSON (a dict, or a list for a batch)."""
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling_params,
                                "return_logprob": return_logprob}
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        if rid is not None:
            body["rid"] = rid
        return await self._json("POST", "/generate", json=body, timeout=timeout)

    async def health(self, *, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        try:
            await self._request("GET", "/health", timeout=timeout)
            return True
        except SGLangError:
            return False

    async def server_info(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        return await self._json("GET", "/server_info", timeout=timeout)

    async def model_info(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        return await self._json("GET", "/model_info", timeout=timeout)

    async def get_weight_version(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> str:
        return str((await self.model_info(timeout=timeout))["weight_version"])

    async def flush_cache(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        await self._request("POST", "/flush_cache", timeout=timeout)

    async def pause_generation(self, mode: str = "abort", *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation mode must be abort|retract|in_place, got {mode!r}")
        await self._json("POST", "/pause_generation", json={"mode": mode}, timeout=timeout)

    async def continue_generation(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        await self._json("POST", "/continue_generation", json={}, timeout=timeout)

    async def abort_all(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        await self._request("POST", "/abort_request", json={"abort_all": True}, timeout=timeout)

    # --- memory (--colocate: the engines give the GPUs to the trainer between rollouts) --------
    async def release_memory_occupation(self, tags: Sequence[str] | None = None, *,
                                        timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Free the engine's GPU memory: `tags` among "weights", "kv_cache", "cuda_graph"; None: all.
        With torch_memory_saver (--enable-memory-saver) only; on CPU it only flushes the KV cache."""
        await self._request("POST", "/release_memory_occupation",
                            json={} if tags is None else {"tags": list(tags)}, timeout=timeout)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None, *,
                                       timeout: float = DEFAULT_TIMEOUT_S) -> None:
        await self._request("POST", "/resume_memory_occupation",
                            json={} if tags is None else {"tags": list(tags)}, timeout=timeout)

    # --- weights --------------------------------------------------------------------------
    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout: float = WEIGHT_UPDATE_TIMEOUT_S) -> dict[str, Any]:
        return await self._checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout=timeout)

    async def begin_weight_update(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        if not self.api.weight_update_session:
            return {"success": True, "message": f"SGLang {self.api.version} has no weight-update session"}
        return await self._checked("/begin_weight_update", {}, timeout=timeout)

    async def end_weight_update(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        if not self.api.weight_update_session:
            return {"success": True, "message": f"SGLang {self.api.version} has no weight-update session"}
        return await self._checked("/end_weight_update", {}, timeout=timeout)

    async def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], group_name: str,
                                              weight_version: str | None = None, flush_cache: bool = True,
                                              load_format: str | None = None,
                                              timeout: float = WEIGHT_UPDATE_TIMEOUT_S) -> dict[str, Any]:
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                                "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._checked("/update_weights_from_distributed", body, timeout=timeout)

    async def update_weights_from_tensor(self, *, serialized_named_tensors: Sequence[str], load_format: str,
                                         flush_cache: bool = True,
                                         timeout: float = WEIGHT_UPDATE_TIMEOUT_S) -> dict[str, Any]:
        """One entry per TP rank of the engine; `load_format` names a --custom-weight-loader
        (rlslurm's receiver: engines/receiver.py)."""
        body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                "flush_cache": flush_cache}
        return await self._checked("/update_weights_from_tensor", body, timeout=timeout)

    async def update_weights_from_disk(self, model_path: str, *, load_format: str | None = None,
                                       weight_version: str | None = None,
                                       timeout: float = WEIGHT_UPDATE_TIMEOUT_S) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._checked("/update_weights_from_disk", body, timeout=timeout)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False,
                                    timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        return await self._checked("/update_weight_version", {
            "new_version": new_version, "abort_all_requests": abort_all_requests}, timeout=timeout)

    async def destroy_weights_update_group(self, group_name: str, *,
                                           timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        return await self._checked("/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return (r.text or r.reason_phrase or "").strip()[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(body)[:500]
