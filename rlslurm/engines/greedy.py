"""Greedy continuations from each engine (`--verify-weight-sync`, trainer/weights/probe.py): temperature 0,
the same token ids in, the served weight version out, so the trainer can compare them with its own.

The probe shares the engines with the rollout driver, which aborts *every* in-flight request of an
engine when it has collected enough groups (rollout/filters.py `_return_in_flight`, the router has
no per-request abort). A probe caught by that abort comes back with the tokens generated so far
(finish_reason abort): it is asked again, up to ABORTED_TRIES times, and reported as an error, not
as different tokens, if it never completes (docs/sglang-behaviour.md: a probe cut short by the abort).
"""

from __future__ import annotations

import httpx

ABORTED_TRIES = 3


def engine_greedy(urls: list[str], api_key: str | None, prompt: list[int], n_new: int,
                  timeout: float = 60.0) -> dict[str, dict]:
    """{url: {tokens, top2, weight_version}}, or {url: {error}} for an engine that did not answer or
    whose answer was cut short every time (see the module docstring).
    `top2`: per generated token, the engine's two most likely [logprob, token id] (trainer/weights/probe.py
    uses them to tell a near-tie flip from different weights)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n_new, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2}
    out: dict[str, dict] = {}
    with httpx.Client(timeout=timeout, trust_env=False, headers=headers) as c:
        for url in urls:
            for _ in range(ABORTED_TRIES):
                out[url] = _ask(c, url, body, n_new)
                if not out[url].get("error", "").startswith("incomplete"):
                    break
    return out


def _ask(c: httpx.Client, url: str, body: dict, n_new: int) -> dict:
    try:
        r = c.post(f"{url}/generate", json=body)
        r.raise_for_status()
        data = r.json()
        meta = data["meta_info"]
        if len(data["output_ids"]) != n_new:
            return {"error": f"incomplete: {len(data['output_ids'])} of {n_new} tokens "
                             f"(finish_reason {meta.get('finish_reason')})"}
        top2 = [[[float(x[0]), int(x[1])] for x in pos[:2]] for pos in meta.get("output_top_logprobs") or []]
        return {"tokens": data["output_ids"], "top2": top2, "weight_version": meta.get("weight_version")}
    except (httpx.HTTPError, KeyError, ValueError, TypeError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
