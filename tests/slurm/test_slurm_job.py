"""`rlslurm submit` against the real SLURM test cluster: sbatch --test-only for every model, the
batch shell's own paths (TERM to it alone, a refused requeue, resubmit, a user error found on a
node), and hostile values that must arrive intact without executing anything. A het job that runs
both groups to the end, with each group's nodes, GPUs and rendezvous, is the GRPO run of
tests/e2e/test_grpo_slurm.py; the one-node job (--nodes 1) is the TERM test's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from rlslurm.settings.model_config import available_models
from rlslurm.user_error import USER_ERROR_EXIT_CODE
from tests.helpers.prompt_files import prompt_lines
from tests.helpers.slurm_runs import env_reports, ledger, rlslurm, wait_reports

pytestmark = pytest.mark.slurm

# A tiny job ends in ~60 s on an idle 2-core host; under a load of ~26 one took over 120 s (a failure
# that said nothing about the job). The bound only decides how long a broken job is waited for.
JOB_TIMEOUT = 360


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "train.jsonl"
    p.write_text(prompt_lines(*({"prompt": f"say {c}", "label": c} for c in "abcdefgh")))
    return p


def tiny_args(run_dir: Path, prompts: Path, *extra: str) -> list[str]:
    return ["--model", "tiny-qwen3", "--nodes", "2", "--prompt-data", str(prompts), "--run-dir", str(run_dir),
            "--gpus-per-node", "2", "--no-exclusive", "--cpus-per-node", "2", "--time", "10",
            "--signal-grace-s", "60", *extra]


def submit_tiny(run_dir: Path, prompts: Path, *extra: str) -> int:
    out = rlslurm("submit", *tiny_args(run_dir, prompts, *extra))
    job = json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"]
    assert f"submitted job {job}" in out.stdout
    return int(job)


ALL = {"trainer-0", "trainer-1", "rollout-0"}


# every model at 2 and 4 nodes; the one-node job (one group, docs/single-node.md) for two of them
@pytest.mark.parametrize("model,nodes", [(m, n) for n in (2, 4) for m in available_models()]
                         + [("qwen3-4B", 1), ("glm4-9B", 1)])
def test_dry_run_script_passes_sbatch_test_only(slurm_cluster, tmp_path: Path, model: str, nodes: int) -> None:
    script = rlslurm("submit", "--model", model, "--nodes", str(nodes), "--dry-run", cwd=tmp_path).stdout
    assert script.startswith("#!/bin/bash")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    p = slurm_cluster.run("sbatch", "--test-only", str(path), cwd=tmp_path, check=False)
    assert p.returncode == 0, f"{model} @ {nodes} nodes: {p.stderr}"
    assert "to start at" in p.stderr


def test_sbatch_extra_reaches_every_het_component(slurm_cluster, tmp_path: Path, prompts: Path) -> None:
    """A real --constraint (boot.sh gives even nodes Feature ci_even, odd ones ci_odd) in --sbatch-extra:
    both het components carry it and run on even nodes. When it was rendered before component 0 only,
    SLURM applied it to the trainer alone and the rollout group ran on n1 (measured, SLURM 22.05)."""
    job = submit_tiny(tmp_path / "run", prompts, "--sbatch-extra=--constraint=ci_even")
    comps = slurm_cluster.wait_state(job, "RUNNING", JOB_TIMEOUT)["het_components"]
    assert [c["Features"] for c in comps] == ["ci_even", "ci_even"], comps
    assert {c["NodeList"] for c in comps} <= {"n2", "n4"}, [c["NodeList"] for c in comps]
    slurm_cluster.cancel(job)


def wait_trainer_polling(run_dir: Path, attempt: int, timeout: float = 120) -> None:
    """Until trainer rank 0 of `attempt` has written its first heartbeat (from its control-file poll)."""
    start = json.loads((run_dir / f"logs/attempt-{attempt}/attempt.json").read_text())["start"]
    hb = run_dir / "control/heartbeats/trainer-0.json"
    deadline = time.monotonic() + timeout
    while not (hb.exists() and json.loads(hb.read_text())["time"] >= start):
        assert time.monotonic() < deadline, f"trainer of attempt {attempt} never polled"
        time.sleep(0.5)


def test_term_to_the_batch_shell_checkpoints_and_ends_without_requeue(slurm_cluster, tmp_path: Path,
                                                                      prompts: Path) -> None:
    """SIGTERM (what scancel, scontrol requeue and preemption send) reaching only the batch shell: it
    asks the trainer for a checkpoint through control/preempt.json, waits for the ack, then ends the
    job without requeueing it (a requeue is SLURM's call when SLURM sends the TERM). The ledger line
    is due before SLURM's KILL (KillWait 5 s here), so TERM once the trainer has published its
    first weights and polls its control files, as it does between rollouts. USR1 and a hard requeue
    are tests/e2e/test_grpo_slurm.py's.

    The job is the one-node layout (--nodes 1, docs/single-node.md), which no other run here uses: one
    group whose two steps (--overlap) share the node, each on its own GPUs of the job's (the
    cluster's GPUs are device files: the split is what each process was given), the weights
    broadcast between them and checked greedy-equal before the TERM."""
    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, prompts, "--num-rollout", "5", "--gpus-per-node", "4", "--rollout-gpus", "1",
                     "--engines-per-node", "1", "--weight-sync", "distributed", "--verify-weight-sync")
    args[args.index("--nodes") + 1] = "1"
    rlslurm("submit", *args)
    job = int(json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"])
    assert slurm_cluster.run("squeue", "-h", "-o", "%i", "-j", str(job)).stdout.split() == [str(job)]  # no het parts
    reps = wait_reports(run_dir, 0, ALL)
    assert "one node, both groups" in rlslurm("status", str(run_dir)).stdout
    probe = run_dir / "control/weight_probe.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not probe.exists() or not probe.read_text().strip():
        assert time.monotonic() < deadline, "no weights published within the job timeout"
        time.sleep(0.5)
    assert json.loads(probe.read_text().splitlines()[0])["match"], probe.read_text()
    wait_trainer_polling(run_dir, 0)
    slurm_cluster.signal_batch(job, "TERM")
    info = slurm_cluster.wait_finished(job, JOB_TIMEOUT)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", info
    [line] = ledger(run_dir)
    assert (line["attempt"], line["exit_code"]) == (0, 143), line
    assert line["reason"].startswith("terminated (SIGTERM") and line["reason"].endswith("; checkpoint acknowledged")
    assert json.loads((run_dir / "control/preempt.json").read_text())["reason"] == "TERM"
    assert (run_dir / "control/preempt_ack.json").exists()
    assert "trainer: checkpoint acknowledged" in (run_dir / f"logs/slurm-{job}.out").read_text()
    # one node for both groups; the job's 4 GPUs: the trainer's 3 first, the engine's 1 first
    assert line["trainer_nodes"] == line["rollout_nodes"] == reps["rollout-0"]["node"] == reps["trainer-1"]["node"]
    job_gpus = reps["trainer-0"]["cuda_visible_devices"].split(",")
    assert len(job_gpus) == 4 and reps["trainer-1"]["cuda_visible_devices"] == ",".join(job_gpus)
    assert reps["rollout-0"]["cuda_visible_devices"] == ",".join(job_gpus[3:] + job_gpus[:3])


def test_refused_requeue_ends_the_job_with_the_reason(slurm_cluster, tmp_path: Path, prompts: Path) -> None:
    """A failed step asks for a requeue; SLURM refuses it for real for a job that is not requeueable
    (--no-requeue after the script's own --requeue). The script retries, then ends the attempt with
    scontrol's answer in the ledger, instead of holding the allocation idle until the time limit."""
    fail = tmp_path / "fail.sh"
    fail.write_text("exit 3\n")  # sourced by every step before python: both steps fail at once
    run_dir = tmp_path / "run"
    job = submit_tiny(run_dir, prompts, "--setup-script", str(fail), "--sbatch-extra=--no-requeue")
    info = slurm_cluster.wait_finished(job, 90)
    batch_log = (run_dir / f"logs/slurm-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", batch_log
    [line] = ledger(run_dir)
    assert line["exit_code"] == 1 and line["reason"].startswith("requeue failed after 3 tries (scontrol: "), line
    assert "was: failed: " in line["reason"] and "rlslurm resubmit" in line["reason"]
    assert "scontrol requeue failed (try 3/3)" in batch_log


def test_resubmit_continues_attempts_and_resets_the_failure_budget_on_request(slurm_cluster, tmp_path: Path,
                                                                             prompts: Path) -> None:
    """Issue 15 item 8: a resubmitted run restarted at attempt 0 (its logs and ledger lines taken for
    the old ones'), gave up at its first failure once the budget was used up, and tripped over the
    old attempt's rendezvous record. Every step fails at once here (a failing setup script), so each
    attempt takes seconds: job 1 uses up --max-failures 1 (attempts 0, 1); a plain resubmit gives up
    at its first failure (attempt 2); a resubmit with --reset-failures is requeued again (3, 4)."""
    fail = tmp_path / "fail.sh"
    fail.write_text("exit 3\n")  # sourced by every step before python: both steps fail at once
    run_dir = tmp_path / "run"

    def job_ends(restarts: str) -> str:
        job = json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"]
        info = slurm_cluster.wait_finished(int(job), JOB_TIMEOUT)
        batch_log = (run_dir / f"logs/slurm-{job}.out").read_text()
        assert (info["JobState"], info["Restarts"]) == ("FAILED", restarts), batch_log
        return job

    submit_tiny(run_dir, prompts, "--setup-script", str(fail), "--max-failures", "1")
    job1 = job_ends("1")
    assert [(l["attempt"], l["reason"].split("; ")[-1]) for l in ledger(run_dir)] == [
        (0, "requeue 1/1"), (1, "rlslurm resubmit --reset-failures continues with a new budget")]
    # what a trainer of attempts 1 and 2 would have left (a run resubmitted before this fix reused 2)
    for a in (1, 2):
        (run_dir / f"control/rendezvous-{a}.json").write_text(json.dumps(
            {"master_addr": "127.0.0.1", "master_port": 29500 + a, "world_size": 2, "group_name": "old", "attempt": a}))

    p = rlslurm("resubmit", str(run_dir))
    assert "--reset-failures gives a new budget" in p.stderr, p.stderr
    job2 = job_ends("0")  # the old count stands: the first failure ends the job
    lines = ledger(run_dir)
    assert lines[2] == {**lines[2], "event": "resubmitted", "next_attempt": 2, "reset_failures": False}
    assert lines[3]["attempt"] == 2 and lines[3]["job_id"] == job2 and "budget (1) exhausted" in lines[3]["reason"]
    assert not list((run_dir / "control").glob("rendezvous-*.json"))  # cleared at the attempt's start

    rlslurm("resubmit", "--reset-failures", str(run_dir))
    job3 = job_ends("1")  # a new budget: requeued once more
    lines = ledger(run_dir)
    assert lines[4] == {**lines[4], "event": "resubmitted", "next_attempt": 3, "reset_failures": True}
    attempts = [l for l in lines if "event" not in l]
    assert [(l["attempt"], l["job_id"]) for l in attempts] == [
        (0, job1), (1, job1), (2, job2), (3, job3), (4, job3)]
    assert attempts[3]["reason"].endswith("requeue 1/1") and "exhausted" in attempts[4]["reason"]
    for a, job in enumerate((job1, job1, job2, job3, job3)):  # each attempt's own logs, none reused
        assert json.loads((run_dir / f"logs/attempt-{a}/attempt.json").read_text())["job_id"] == job
    assert sorted(p.name for p in (run_dir / "logs").glob("attempt-*")) == [f"attempt-{a}" for a in range(5)]
    st = json.loads(rlslurm("status", str(run_dir), "--json").stdout)
    assert [a["attempt"] for a in st["attempts"]] == [0, 1, 2, 3, 4] and st["current_attempt"] is None
    assert [r["reset_failures"] for r in st["resubmits"]] == [False, True]
    human = rlslurm("status", str(run_dir)).stdout
    rows = [r for l in human.split("\n\n")[-1].splitlines() if len(r := l.split("\t")) == 6]  # piped: TSV
    assert rows[0][0] == "attempt" and [r[0] for r in rows[1:]] == ["0", "1", "", "2", "", "3", "4"]
    assert [r[-1] for r in rows[1:] if not r[0]] == ["resubmitted", "resubmitted, new failure budget"]


def test_user_error_found_on_a_node_ends_the_job_without_requeue(slurm_cluster, tmp_path: Path,
                                                                   prompts: Path) -> None:
    """What only a node can find is final (rlslurm/user_error.py): here a --megatron-* field, which
    submit cannot check because the job runs another environment (a --setup-script may switch to
    another megatron-core), refused by the trainer's megatron at start-up. No requeue, the message
    in the ledger and in `rlslurm status`."""
    setup = tmp_path / "env.sh"
    setup.write_text("true\n")
    run_dir = tmp_path / "run"
    p = rlslurm("submit", *tiny_args(run_dir, prompts, "--setup-script", str(setup), "--max-failures", "3",
                                     "--megatron-no-such-field", "1"))
    assert "--megatron-* fields not checked here" in p.stderr, p.stderr
    job = json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"]
    info = slurm_cluster.wait_finished(int(job), JOB_TIMEOUT)
    batch_log = (run_dir / f"logs/slurm-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", batch_log
    assert info["ExitCode"] == f"{USER_ERROR_EXIT_CODE}:0", (info["ExitCode"], batch_log, ledger(run_dir))
    [line] = ledger(run_dir)
    assert line["exit_code"] == USER_ERROR_EXIT_CODE, line
    assert line["reason"].startswith(
        "user error: --megatron-no-such-field: 'no_such_field' is not a megatron-core"), line
    human = rlslurm("status", str(run_dir)).stdout
    assert f"{line['reason']} (attempt 0, role trainer, host " in human, human
    assert "the job was not requeued" in human
    st = json.loads(rlslurm("status", str(run_dir), "--json").stdout)
    assert st["user_error"]["reason"] == line["reason"] and st["user_error"]["role"] == "trainer"


HOSTILE = "$(touch pwned)`touch pwned2` it's \"q\"\nline2 $HOME"


def test_hostile_values_arrive_intact_and_nothing_executes(slurm_cluster, tmp_path: Path) -> None:
    # and a secret, passed by control/secret_env (0600): set in the job, written nowhere else
    secret = "hf_" + os.urandom(8).hex() + HOSTILE.replace("pwned", "pwned5")
    base = tmp_path / "a b'c"
    base.mkdir()
    prompts = base / "p $(touch pwned3) `x`.jsonl"
    prompts.write_text(json.dumps({"prompt": "say a", "label": "a"}) + "\n")
    run_dir = base / "run $(touch pwned4) 'q' `y`"
    job = submit_tiny(run_dir, prompts, "--num-rollout", "0", "--run-name", HOSTILE,
                      f"--sglang-chat-template={HOSTILE}", "--env", f"RL_TEST_VAR={HOSTILE}", f"HF_TOKEN={secret}")
    info = slurm_cluster.wait_finished(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", (run_dir / f"logs/slurm-{job}.out").read_text()
    reps = env_reports(run_dir, 0)
    for r in (reps["trainer-0"], reps["rollout-0"]):
        assert r["run_name"] == HOSTILE
        assert r["sglang_args"] == ["--chat-template", HOSTILE]
        assert r["prompt_data"] == str(prompts)
        assert r["user_env"] == {"RL_TEST_VAR": HOSTILE}
        assert r["secret_env_set"] == ["HF_TOKEN"]
    holders = [p for p in run_dir.rglob("*") if p.is_file() and secret.split("$")[0].encode() in p.read_bytes()]
    assert holders == [run_dir / "control" / "secret_env"], holders
    key = (run_dir / "control" / "api_key").read_bytes().strip()  # the engines printed it: masked in their logs
    assert list((run_dir / "logs" / "attempt-0").glob("engine-*.log"))
    assert [p for p in run_dir.rglob("*") if p.is_file() and key in p.read_bytes()] == [run_dir / "control" / "api_key"]
    leaked = [p for d in (tmp_path, base, run_dir, Path.cwd(), Path.home()) for p in d.glob("pwned*")]
    assert not leaked, leaked

