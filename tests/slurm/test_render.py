"""The rendered het-job script: valid bash, directives as SLURM expects, user values quoted."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.resolve import resolve
from rlslurm.settings.model_config import available_models
from rlslurm.slurm.render import job_name, render


def _render(*argv: str) -> str:
    res = resolve(list(argv), strict_inputs=False)
    return render(res.cfg, res.cfg.run_dir.resolve())


@pytest.mark.parametrize("model", available_models())
def test_every_model_renders_valid_bash(model: str) -> None:
    script = _render("--model", model, "--nodes", "2")
    r = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    assert script.count("#SBATCH hetjob") == 1
    assert "--signal=B:USR1@" in script and "#SBATCH --requeue" in script and "--open-mode=append" in script


def test_groups_get_their_nodes_partitions_and_gpus() -> None:
    script = _render("--model", "glm4-9B", "--nodes", "6", "--trainer-nodes", "4", "--gpus-per-node", "4",
                     "--rollout-num-gpus-per-engine", "2", "--trainer-partition", "train", "--rollout-partition",
                     "infer", "--account", "proj1", "--qos", "high", "--time", "2-00:00:00",
                     "--tensor-model-parallel-size", "2")
    g0, g1 = script.split("#SBATCH hetjob")
    assert "--nodes=4" in g0 and "--partition=train" in g0 and "--gpus-per-node=4" in g0
    assert "--nodes=2" in g1 and "--partition=infer" in g1 and "--gpus-per-node=4" in g1
    assert "#SBATCH --account=proj1" in g0 and "#SBATCH --qos=high" in g0 and "#SBATCH --time=2-00:00:00" in g0


def test_a_rollout_group_without_engines_holds_no_gpus(tmp_path: Path) -> None:
    """A replay starts no engine (its rollout group only waits): its nodes ask for no GPUs."""
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.buffer.writer import RolloutWriter
    from tests.buffer.helpers import make_meta, make_samples

    src = RunDir.create(tmp_path / "earlier-run")
    RolloutWriter(src).commit(0, make_samples(0, n=4), make_meta(0))
    script = _render("--model", "qwen3-4B", "--nodes", "2", "--gpus-per-node", "4", "--load-debug-rollout-data",
                     str(src.path))
    g0, g1 = script.split("#SBATCH hetjob")
    assert "--gpus-per-node=4" in g0 and "--gpus-per-node" not in g1


def test_container_and_setup_are_quoted(tmp_path: Path) -> None:
    setup = tmp_path / "my env.sh"
    setup.write_text("true\n")
    script = _render("--model", "tiny-qwen3", "--container-image", "nvcr.io/x/y:1 $(id)", "--container-mounts",
                     "/a:/a,/b:/b", "--setup-script", str(setup))
    assert "--container-image='nvcr.io/x/y:1 $(id)'" in script
    assert f"'{setup}'" in script


def test_hostile_run_name_and_dir_never_reach_the_shell_unquoted(tmp_path: Path) -> None:
    name = "x$(touch pwned)`touch pwned2`'\"\n y"
    rd = tmp_path / "dir with 'quotes' $(touch pwned3)"
    script = _render("--model", "tiny-qwen3", "--run-name", name, "--run-dir", str(rd),
                     "--env", "MY_VAR=$(touch pwned4)")
    assert f"#SBATCH --job-name={job_name(name)}\n" in script
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", job_name(name))
    r = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    # Evaluate only the variable assignments and check the values come out intact.
    assigns = [l for l in script.splitlines() if l.startswith(("RUN_DIR=", "export MY_VAR="))]
    out = subprocess.run(["bash", "-c", "\n".join(assigns) + '\nprintf "%s\\n%s" "$RUN_DIR" "$MY_VAR"'],
                         text=True, capture_output=True, cwd=tmp_path)
    assert out.stdout == f"{rd}\n$(touch pwned4)"
    assert not list(tmp_path.glob("pwned*"))


def test_percent_in_run_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'%' is not allowed"):
        _render("--model", "tiny-qwen3", "--run-dir", str(tmp_path / "a%jb"))


def test_extra_sbatch_options_must_be_plain() -> None:
    assert "#SBATCH --constraint=h100" in _render("--model", "tiny-qwen3", "--sbatch-extra=--constraint=h100")
    with pytest.raises(ConfigError, match="--sbatch-extra"):
        _render("--model", "tiny-qwen3", "--sbatch-extra=--constraint=$(id)")


def _components(script: str) -> list[list[str]]:
    """The #SBATCH lines of each het component (the job-wide ones count as component 0's)."""
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    parts: list[list[str]] = [[]]
    for line in directives:
        if line == "#SBATCH hetjob":
            parts.append([])
        else:
            parts[-1].append(line.removeprefix("#SBATCH "))
    return parts


def test_extra_sbatch_options_reach_every_het_component() -> None:
    """SLURM applies an option before the first `hetjob` line to component 0 only: a --constraint
    there left the rollout group free to run anywhere (the SLURM check: test_slurm_job.py)."""
    trainer, rollout = _components(_render("--model", "tiny-qwen3", "--nodes", "2", "--sbatch-extra=--constraint=h100",
                                           "--sbatch-extra=--exclude=n7", "--trainer-sbatch-extra=--gres=gpu:8",
                                           "--rollout-sbatch-extra=--constraint=h100"))
    assert trainer.count("--constraint=h100") == 1 and "--exclude=n7" in trainer and "--gres=gpu:8" in trainer
    assert rollout.count("--constraint=h100") == 1 and "--exclude=n7" in rollout and "--gres=gpu:8" not in rollout
    [one] = _components(_render("--model", "tiny-qwen3", "--nodes", "1", "--gpus-per-node", "2",
                                "--trainer-sbatch-extra=--gres=gpu:2", "--rollout-sbatch-extra=--exclude=n7"))
    assert "--gres=gpu:2" in one and "--exclude=n7" in one  # one group runs both roles
    with pytest.raises(ConfigError, match=r"^--sbatch-extra takes one sbatch option after '=': "
                                          r"--sbatch-extra=--constraint=h100 \(repeat"):
        _render("--model", "tiny-qwen3", "--sbatch-extra", "--constraint=h100")


def test_trainer_port_is_never_one_rlslurm_picks_for_itself() -> None:
    """Virtual-node clusters put both het groups on one host: an engine that picked the trainer's
    rendezvous port first made torchrun's store fail with EADDRINUSE (seen in CI). The batch
    script's port lies below every port `net.allocate_ports` hands out, and below the ephemeral
    range, for any job id and attempt."""
    from rlslurm import net

    [expr] = re.findall(r"^TRAINER_PORT=\$\(\( (.+) \)\)$", _render("--model", "tiny-qwen3", "--nodes", "2"), re.M)
    ports = subprocess.run(
        ["bash", "-c", f'for SLURM_JOB_ID in 1 7 4093 65535 999983; do for ATTEMPT in 0 1 2 5; do '
                       f'echo $(( {expr} )); done; done'], capture_output=True, text=True, check=True).stdout.split()
    assert len(ports) == 20 and len(set(ports)) > 10
    assert all(1024 < int(p) < net._LOW_PORT for p in ports), ports
    assert net._LOW_PORT <= min(net.ephemeral_range())
    assert all(net._LOW_PORT <= p < net.ephemeral_range()[0] for p in net.allocate_ports("127.0.0.1", 50))


def test_dict_flags_add_up_across_repeats_and_the_config_file(tmp_path: Path) -> None:
    """Every dict setting (--env, --apply-chat-template-kwargs): a repeated flag and a YAML value plus a
    flag keep the keys of both (a dropped NCCL_SOCKET_IFNAME or SGLANG_ZMQ_ALLOWED_PEERS would go
    unnoticed); one key with two values is one line naming both sources."""
    from rlslurm.settings.flags import FIELDS, _kind, flag_name

    dict_fields = sorted(n for n, (_, ann) in FIELDS.items() if _kind(ann) == "dict")
    assert dict_fields == ["apply_chat_template_kwargs", "env"]  # a new one joins this test
    conf = tmp_path / "run.yaml"
    conf.write_text("env:\n  NCCL_SOCKET_IFNAME: ib0\napply_chat_template_kwargs:\n  enable_thinking: false\n")
    res = resolve(["--model", "tiny-qwen3", "--env", "A=1", "--env", "SGLANG_ZMQ_ALLOWED_PEERS=10.0.0.1",
                   "--apply-chat-template-kwargs", "tools=x", "--apply-chat-template-kwargs", '{"k": 2}',
                   "--env", "A=1"], conf, strict_inputs=False)
    assert res.cfg.slurm.env == {"NCCL_SOCKET_IFNAME": "ib0", "A": "1", "SGLANG_ZMQ_ALLOWED_PEERS": "10.0.0.1"}
    assert res.cfg.data.apply_chat_template_kwargs == {"enable_thinking": False, "tools": "x", "k": 2}
    script = render(res.cfg, res.cfg.run_dir.resolve())
    for line in ("export NCCL_SOCKET_IFNAME=ib0", "export A=1", "export SGLANG_ZMQ_ALLOWED_PEERS=10.0.0.1"):
        assert line in script.splitlines(), line
    for name in dict_fields:
        flag = flag_name(name)
        with pytest.raises(ConfigError) as e:
            resolve(["--model", "tiny-qwen3", flag, "K=1", flag, "K=2"], strict_inputs=False)
        assert str(e.value) == \
            f"{flag} K: given twice with different values, '1' ({flag}) and '2' ({flag}); give it once"
    with pytest.raises(ConfigError, match=r"--env NCCL_SOCKET_IFNAME: given twice with different values, 'ib0' "
                                          r"\(.*run.yaml:1\) and 'eth0' \(--env\)"):
        resolve(["--model", "tiny-qwen3", "--env", "NCCL_SOCKET_IFNAME=eth0"], conf, strict_inputs=False)
