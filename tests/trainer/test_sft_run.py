"""SFT end to end without any engine: `rlslurm run --debug-train-only --loss-type sft_loss` on
multi-turn conversations (slime's SFT recipe). The rollout node starts no SGLang server and no router:
its driver builds each rollout with rlslurm/rollout/sft.py and commits it with the data cursor; the
trainer (megatron-core on CPU, under torchrun) trains it with sft_loss. Checked, over a stop midway and
the same command again: the loss falls, every rollout is trained once, every conversation is served
once per epoch in order, the buffer's loss masks are 1 exactly on the assistant turns' tokens, and the
masks the loss was computed with (--save-debug-train-data) are those."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "say digits"}, {"role": "assistant", "content": "1 2 3"}],
    [{"role": "user", "content": "say letters"}, {"role": "assistant", "content": "a b c"}],
    [{"role": "user", "content": "say digits"}, {"role": "assistant", "content": "1 2 3"},
     {"role": "user", "content": "say letters"}, {"role": "assistant", "content": "a b c"}],
    [{"role": "user", "content": "add 1 + 2"}, {"role": "assistant", "content": "call add"},
     {"role": "tool", "content": "result 3"}, {"role": "assistant", "content": "the answer is 3"},
     {"role": "user", "content": "copy x"}],
]
NUM_ROLLOUT = 40  # a stop after 3 trained rollouts lands well before the end


def assistant_words(conv: list[dict]) -> list[str]:
    """What the loss must see: each assistant turn's words and the <eos> that ends it."""
    return [w for m in conv if m["role"] == "assistant" for w in m["content"].split() + ["<eos>"]]


def sft_command(tmp_path: Path, tiny_hf: Path, num_rollout: int, *extra: str) -> tuple[list[str], Path]:
    """`rlslurm run` of slime's SFT recipe on CONVERSATIONS, and its run directory."""
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    tc = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": TEMPLATE}))
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    run = tmp_path / "run"
    return [sys.executable, "-m", "rlslurm.cli", "run", "--model", "tiny-qwen3", "--hf-checkpoint", str(hf),
            "--prompt-data", str(data), "--input-key", "messages", "--apply-chat-template",
            "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--debug-train-only",
            "--loss-type", "sft_loss", "--calculate-per-token-loss", "--run-dir", str(run), "--no-progress",
            "--num-rollout", str(num_rollout), "--rollout-batch-size", "4", "--n-samples-per-prompt", "1",
            "--global-batch-size", "4", "--num-steps-per-rollout", "1", "--micro-batch-size", "2",
            "--trainer-procs-per-node", "1", "--num-epoch", "100", "--lr", "1e-2", "--keep-trained-rollouts",
            "1000", *extra], run


def test_sft_trains_assistant_turns_without_engines_and_resumes_after_a_stop(tmp_path: Path, tiny_hf: Path) -> None:
    """The SFT run, stopped midway (the trainer saves and acks, the driver hands back its cursor) and
    continued by the same command again (one run for both checks: each `rlslurm run` starts a
    trainer under torchrun). Over the two attempts: every rollout is trained once, every conversation is
    served once per epoch, in the unshuffled order, across the stop; the loss falls; the buffer's masks
    cover exactly the assistant turns and are the masks the loss was computed with."""
    import time

    from rlslurm.buffer import RunDir
    from rlslurm.buffer.control import Control
    from rlslurm.buffer.reader import RolloutReader
    from rlslurm.tiny import WORDS

    n = NUM_ROLLOUT
    cmd, run = sft_command(tmp_path, tiny_hf, n, "--no-rollout-shuffle", "--save-debug-train-data",
                           str(tmp_path / "train-data" / "{rollout_id}-{rank}.pt"))
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            metrics = run / "metrics.jsonl"
            deadline = time.time() + 600
            while time.time() < deadline and proc.poll() is None:
                if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                    Control(run).request_stop("test: stop midway")
                    break
                time.sleep(0.1)
            assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not RunDir(run).is_finished()
    first = [json.loads(x)["rollout_id"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert 3 <= len(first) < n, first
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    rollout_log = "".join(f.read_text() for f in sorted((run / "logs").glob("attempt-*/rollout-0.log")))
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}\n--- rollout log\n{rollout_log[-4000:]}"
    assert RunDir(run).is_finished()

    # no engine, no router: the rollout node built the rollouts itself
    assert "--debug-train-only: node 0 builds the rollouts with rlslurm.rollout.sft:generate_rollout" in rollout_log
    assert Control(run).engines() == [] and Control(run).router() is None

    # each rollout trained once, over the two attempts, and the SFT loss fell
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["rollout_id"] for x in lines] == list(range(n))
    assert len({x["attempt"] for x in lines}) == 2
    losses = [x["loss"] for x in lines]
    assert all("pg_loss" not in x for x in lines)
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.7 * first, losses

    # the buffer: one sample per conversation, served once per epoch in order across the stop, trained
    # exactly on the assistant turns' tokens
    reader = RolloutReader(RunDir(run), readonly=True)
    assert reader.committed_ids() == list(range(n))
    served = [(s.metadata["prompt_epoch"], s.metadata["prompt_index"])
              for rid in range(n) for s in reader.read(rid).samples]
    k = len(CONVERSATIONS)
    assert served == [(i // k, i % k) for i in range(n * 4)]
    for rid in range(n):
        rollout = reader.read(rid)
        assert len(rollout.samples) == 4
        saved = torch.load(tmp_path / "train-data" / f"{rid}-0.pt")
        for i, s in enumerate(rollout.samples):
            conv = CONVERSATIONS[s.metadata["prompt_index"]]
            words = [WORDS[t] for t in s.tokens]
            mask = [0] * len(s.prompt_tokens) + s.effective_loss_mask().tolist()
            assert [w for w, m in zip(words, mask) if m] == assistant_words(conv), (rid, i, words, mask)
            headers = [k for k in range(len(words) - 1) if words[k:k + 2] == ["assistant", ":"]]
            assert headers and all(mask[k] == 0 and mask[k + 1] == 0 for k in headers)
            assert s.reward == 0.0 and s.rollout_logprobs is None
            # the loss saw exactly these masks
            assert saved["loss_masks"][i].tolist() == s.effective_loss_mask().astype(float).tolist()
            # sft_loss reads no sampling-policy log-probs: their recompute (a forward pass) is skipped
            assert not saved["old_logprobs"][i].any()
    rm = [json.loads(x) for x in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    assert [x["rollout_id"] for x in rm] == list(range(n))
    assert all(x["rollout/sft/trained_tokens"] > 0 for x in rm)
