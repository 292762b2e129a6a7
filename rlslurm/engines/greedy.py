"""Greedy continuations from each engine (`--verify-weight-sync`, trainer/probe.py): temperature 0,
the same token ids in, the served weight version out, so the trainer can compare them with its own."""

from __future__ import annotations

import httpx


def engine_greedy(urls: list[str], api_key: str | None, prompt: list[int], n_new: int,
                  timeout: float = 60.0) -> dict[str, dict]:
    """{url: {tokens, top2, weight_version}} or {url: {error}} for an engine that did not answer.
    `top2`: per generated token, the engine's two most likely [logprob, token id] (trainer/probe.py
    uses them to tell a near-tie flip from different weights)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n_new, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2}
    out: dict[str, dict] = {}
    with httpx.Client(timeout=timeout, trust_env=False, headers=headers) as c:
        for url in urls:
            try:
                r = c.post(f"{url}/generate", json=body)
                r.raise_for_status()
                data = r.json()
                meta = data["meta_info"]
                top2 = [[[float(x[0]), int(x[1])] for x in pos[:2]] for pos in meta.get("output_top_logprobs") or []]
                out[url] = {"tokens": data["output_ids"], "top2": top2, "weight_version": meta.get("weight_version")}
            except (httpx.HTTPError, KeyError, ValueError, TypeError, IndexError) as e:
                out[url] = {"error": f"{type(e).__name__}: {e}"}
    return out
