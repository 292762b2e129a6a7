"""SGLang version differences live in engines/sglang_versions.py: the weight-update session exists in
0.5.23 and not in 0.5.14 (the GPU machines' version), and the trainer's clients follow the version each
engine recorded."""

from __future__ import annotations

import asyncio

import pytest

from rlslurm.buffer.control import EngineRecord
from rlslurm.engines.fanout import engine_targets
from rlslurm.engines.sglang_client import SGLangClient, SGLangError
from rlslurm.engines.sglang_versions import DEFAULT, SUPPORTED, api_for
from rlslurm.errors import ConfigError

NOWHERE = "http://127.0.0.1:9"  # discard port: nothing listens, a request fails at once


def test_api_for_known_unknown_and_unrecorded() -> None:
    assert api_for("0.5.14").weight_update_session is False
    assert api_for("0.5.23").weight_update_session is True
    assert api_for(None) is DEFAULT
    with pytest.raises(ConfigError, match="SGLang 0.4.0 is not supported.*0.5.14, 0.5.23"):
        api_for("0.4.0")


def test_session_calls_are_skipped_without_a_request_on_0_5_14() -> None:
    async def calls(api):
        async with SGLangClient(NOWHERE, "k", api=api) as c:
            return await c.begin_weight_update(timeout=2), await c.end_weight_update(timeout=2)

    begin, end = asyncio.run(calls(SUPPORTED["0.5.14"]))
    assert begin["success"] and end["success"]
    with pytest.raises(SGLangError, match="begin_weight_update"):  # 0.5.23 sends it
        asyncio.run(calls(SUPPORTED["0.5.23"]))


def test_engine_targets_carry_the_recorded_version() -> None:
    recs = [EngineRecord(url="http://a:1", node="n", healthy=True, sglang_version="0.5.14"),
            EngineRecord(url="http://b:1", node="n", healthy=True)]
    assert [t.sglang_version for t in engine_targets(recs)] == ["0.5.14", None]
    again = EngineRecord.model_validate_json(recs[0].model_dump_json())
    assert again.sglang_version == "0.5.14"
