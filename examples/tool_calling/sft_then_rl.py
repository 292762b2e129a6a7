"""The tool-calling example trained end to end on the CPU demo stack: SFT, then RL.

A random-init tiny model never writes `call add ( 3 4 )` by chance, so RL alone has nothing to
reinforce. As in slime's recipes, a short SFT (engine-free, `--debug-train-only --loss-type
sft_loss`) first teaches the format from transcripts; its `--save-hf` export then starts GRPO with
this directory's multi-turn generate function on real SGLang engines: the tool's output is in the
context of the next turn with loss mask 0, and the reward is the final answer.

    python examples/tool_calling/sft_then_rl.py --work /tmp/tool-demo

Prints one JSON line: the SFT loss first/last, the RL reward per rollout (and its first and last five
rollouts' means) and the engine requests per sample (2: one tool call, then the answer).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Every turn ends with <eos>, so the model learns to stop (the tiny tokenizer's own template has none).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


def problems(n: int, seed: int) -> list[list[int]]:
    """`add` problems of two or three digits."""
    rng = random.Random(seed)
    return [[rng.randrange(10) for _ in range(rng.choice((2, 2, 3)))] for _ in range(n)]


def transcript(args: list[int]) -> str:
    """What the generate function produces for a model that calls the tool and copies its result:
    one assistant turn, the tool's `result = ...` inside it (generate.py appends it there)."""
    digits = " ".join(str(sum(args)))
    return f"call add ( {' '.join(map(str, args))} ) result = {digits} answer {digits}"


def write_data(work: Path, seed: int) -> tuple[Path, Path]:
    sft, rl = work / "sft.jsonl", work / "rl.jsonl"
    with sft.open("w") as f:
        for args in problems(200, seed):
            prompt = f"add {' '.join(map(str, args))} ?"
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": transcript(args)}]}) + "\n")
    with rl.open("w") as f:
        for args in problems(64, seed + 1):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"add {' '.join(map(str, args))} ?"}],
                                "label": str(sum(args))}) + "\n")
    return sft, rl


def rlslurm_run(*flags: str, cwd: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "rlslurm.cli", "run", "--no-progress", *flags], cwd=cwd)
    if p.returncode != 0:
        sys.exit(f"sft_then_rl: rlslurm run {' '.join(flags[:4])}... failed (rc {p.returncode})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--sft-rollouts", type=int, default=300)
    ap.add_argument("--rl-rollouts", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rl-lr", type=float, default=1e-3)
    ap.add_argument("--rl-prompts", type=int, default=16, help="prompts per RL rollout")
    ap.add_argument("--rl-samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--reuse-sft", action="store_true", help="keep WORK/sft-hf from an earlier run (experiments)")
    ap.add_argument("--rl-colocate", action="store_true",
                    help="GRPO with the trainer and the engines taking turns (--colocate), every sync verified")
    a = ap.parse_args()
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    work = a.work.resolve()
    if a.reuse_sft and (work / "sft-hf").exists():
        shutil.rmtree(work / "rl", ignore_errors=True)
        return rl(a, work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hf = make_tiny_checkpoint(load_model_config("tiny-qwen3"), work / "hf-init", seed=a.seed)
    tc = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": TEMPLATE}))
    sft_data, rl_data = write_data(work, a.seed)
    common = ["--model", "tiny-qwen3", "--trainer-procs-per-node", "1", "--apply-chat-template"]

    # 1. SFT on transcripts, no engines; the last weights exported in HF format
    rlslurm_run(*common, "--hf-checkpoint", str(hf), "--prompt-data", str(sft_data), "--input-key", "messages",
                "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--debug-train-only",
                "--loss-type", "sft_loss", "--calculate-per-token-loss", "--run-dir", str(work / "sft"),
                "--num-rollout", str(a.sft_rollouts), "--rollout-batch-size", "16", "--n-samples-per-prompt", "1",
                "--global-batch-size", "16", "--num-steps-per-rollout", "1", "--micro-batch-size", "4", "--num-epoch",
                "100", "--lr", "1e-2",
                "--save-interval", str(a.sft_rollouts), "--save-hf", str(work / "sft-hf"), cwd=work)
    rl(a, work)


def rl(a: argparse.Namespace, work: Path) -> None:
    common = ["--model", "tiny-qwen3", "--trainer-procs-per-node", "1", "--apply-chat-template"]
    rl_data = work / "rl.jsonl"
    sft_lines = [json.loads(x) for x in (work / "sft" / "metrics.jsonl").read_text().splitlines()]
    # the export carries the tokenizer files, chat template included, for the engines and the driver
    tc = json.loads((work / "sft-hf" / "tokenizer_config.json").read_text())

    # 2. GRPO with the multi-turn generate function on real engines, from the SFT weights
    rlslurm_run(*common, "--hf-checkpoint", str(work / "sft-hf"), "--prompt-data", str(rl_data),
                "--input-key", "prompt", "--label-key", "label",
                "--custom-generate-function-path", f"{HERE / 'generate.py'}:generate",
                "--custom-rm-path", f"{HERE / 'reward.py'}:answer_reward", "--run-dir", str(work / "rl"),
                "--num-rollout", str(a.rl_rollouts), "--rollout-batch-size", str(a.rl_prompts),
                "--n-samples-per-prompt", str(a.rl_samples), "--global-batch-size", str(a.rl_prompts * a.rl_samples),
                "--num-steps-per-rollout", "1",
                "--rollout-max-response-len", "24", "--rollout-temperature", "1.0", "--num-epoch", "100",
                "--lr", str(a.rl_lr), "--rollout-dtype", "float32", "--save-interval", "1000",
                *(["--colocate", "--verify-weight-sync"] if a.rl_colocate else []), cwd=work)
    rm = [json.loads(x) for x in (work / "rl" / "rollout_metrics.jsonl").read_text().splitlines()]
    train = [r for r in rm if r.get("kind", "train") == "train"]
    print(json.dumps({
        "example": "tool_calling sft_then_rl",
        "sft_loss_first_last": [sft_lines[0]["loss"], sft_lines[-1]["loss"]],
        "rl_reward_mean": [round(r["rollout/reward_mean"], 3) for r in train],
        # GRPO's effect on top of the SFT: the first and the last five rollouts' mean reward
        "rl_reward_first5_last5": [round(sum(r["rollout/reward_mean"] for r in part) / len(part), 3)
                                   for part in (train[:5], train[-5:])],
        # one engine request per model turn: 2 where the model called the tool once and answered
        "rl_turns_per_sample": [round(r["rollout/engine/requests"] / (a.rl_prompts * a.rl_samples), 2) for r in train],
        "tokenizer_template_kept": tc.get("chat_template") == TEMPLATE,
    }))


if __name__ == "__main__":
    main()
