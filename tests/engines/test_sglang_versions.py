"""SGLang version differences live in engines/sglang_versions.py: the weight-update session exists in
0.5.23 and not in 0.5.14 (the GPU machines' version), and the trainer's clients follow the version each
engine recorded."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest

from rlslurm.buffer.control import EngineRecord
from rlslurm.engines import sglang_versions
from rlslurm.engines.fanout import engine_targets
from rlslurm.engines.sglang_client import SGLangClient, SGLangError
from rlslurm.engines.sglang_versions import DEFAULT, SUPPORTED, api_for, check_gpu_sglang
from rlslurm.errors import ConfigError

NOWHERE = "http://127.0.0.1:9"  # discard port: nothing listens, a request fails at once


def test_api_for_known_unknown_and_unrecorded() -> None:
    assert api_for("0.5.14").weight_update_session is False
    assert api_for("0.5.23").weight_update_session is True
    assert api_for(None) is DEFAULT
    # an untested version (started with --allow-untested-sglang): the nearest tested API at or below it
    assert api_for("0.5.20.post1") is SUPPORTED["0.5.14"] and api_for("0.6.1") is SUPPORTED["0.5.23"]
    assert api_for("0.4.0") is SUPPORTED["0.5.14"]


@pytest.mark.parametrize("installed", ["0.5.20", "0.6.0.post2"])
def test_an_untested_gpu_sglang_is_refused_unless_allowed(monkeypatch, caplog, installed: str) -> None:
    """Issue 33 item 7: the tested versions, or --allow-untested-sglang's warning; the error names the
    extra, with its constraints file, that installs the GPU stack's version (issue 48: no extra installs
    0.5.23, which pins a torch nobody ran on a GPU), and the flag."""
    monkeypatch.setattr(sglang_versions, "installed_sglang_version", lambda: installed)
    with pytest.raises(ConfigError, match=rf"^rollout device cuda: SGLang is {re.escape(installed)}, not a tested "
                                          r"version \(0.5.14, 0.5.23\); pip install -c constraints/gpu-torch211.txt "
                                          r"'rlslurm\[sglang-torch211\]' \(SGLang 0.5.14\), or "
                                          r"--allow-untested-sglang to try it"):
        check_gpu_sglang()
    with caplog.at_level(logging.WARNING, logger="rlslurm.engines.sglang_versions"):
        api = check_gpu_sglang(allow_untested=True)
    assert api is api_for(installed) and f"SGLang {installed} is not a tested version" in caplog.text
    monkeypatch.setattr(sglang_versions, "installed_sglang_version", lambda: "0.5.14")
    assert check_gpu_sglang() is SUPPORTED["0.5.14"]


def test_the_api_table_is_the_stacks_sglang() -> None:
    """One list: the versions with an API here are the SGLang of rlslurm/stacks.py's stacks, and only the
    CPU stack's has the CPU path (rlslurm/engines/sglang_cpu)."""
    from rlslurm.stacks import STACKS

    assert set(SUPPORTED) == {s.sglang for s in STACKS} == {"0.5.14", "0.5.23"}
    assert [v for v, api in SUPPORTED.items() if api.cpu_path] == [s.sglang for s in STACKS if s.name == "cpu"]


def test_the_flag_reaches_every_gpu_engine(tmp_path: Path) -> None:
    from rlslurm.resolve import resolve
    from rlslurm.rollout.node import engine_specs

    argv = ["--model", "tiny-qwen3", "--nodes", "2", "--gpus-per-node", "2"]
    for extra, want in (([], False), (["--allow-untested-sglang"], True), (["--allow-untested-stack"], True)):
        cfg = resolve(argv + extra, strict_inputs=False).cfg
        cfg.model.hf_checkpoint = tmp_path  # the servers' model; not read here
        specs = engine_specs(cfg, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path)
        assert specs and all(s.allow_untested_sglang is want for s in specs)


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
