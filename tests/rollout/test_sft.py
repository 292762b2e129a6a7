"""SFT rollouts (rlslurm/rollout/sft.py): the assistant-turn loss mask from a real HF tokenizer's chat
template, exact on multi-turn conversations; the one-line errors when a template or tokenizer makes
the turns impossible to separate; the rollout function over a real PromptSource. Fast: no engine,
no trainer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlslurm.errors import ConfigError, DataError
from rlslurm.rollout.data import PromptSource
from rlslurm.rollout.rollout_fn import TrackedSource
from rlslurm.rollout.sft import generate_rollout, mask_conversation, sft_sample
from rlslurm.settings.config import RunConfig
from tests.rollout.chat_tokenizer import CONV, WORDS, make_tokenizer

QWEN3_LIKE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} "
              "{% if m['role'] == 'assistant' and loop.last %}<think> </think> {% endif %}"
              "{{ m['content'] }} <|im_end|> {% endfor %}"
              "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
# no space between the header and the content: a whitespace tokenizer sees one word across the boundary
GLUED = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} {% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")




def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def trained_text(tok, conv) -> list[str]:
    return [WORDS[t] for t, m in zip(conv.tokens, conv.loss_mask) if m]




def test_multi_turn_mask_is_exactly_the_assistant_turns() -> None:
    tok = make_tokenizer()
    conv = mask_conversation(tok, CONV, where="data.jsonl:3")
    assert conv.tokens == ids(tok, tok.apply_chat_template(CONV, tokenize=False))
    # content and the end-of-turn token of each assistant turn; not its header, nor any other turn
    assert trained_text(tok, conv) == ["hello", "there", "<|im_end|>", "fine", "thanks", "<|im_end|>"]
    words = [WORDS[t] for t in conv.tokens]
    expect = [0] * len(words)
    for start in (words.index("hello"), words.index("fine")):
        expect[start:start + 3] = [1, 1, 1]
    assert conv.loss_mask == expect


def test_tool_turns_and_step_loss_mask_are_not_trained() -> None:
    tok = make_tokenizer()
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "call f", "step_loss_mask": 0},
            {"role": "tool", "content": "result 42"},
            {"role": "assistant", "content": "it is 42"},
            {"role": "user", "content": "ok"}]
    conv = mask_conversation(tok, msgs)
    assert trained_text(tok, conv) == ["it", "is", "42", "<|im_end|>"]
    s = sft_sample(tok, SimpleNamespace(messages=None, prompt=msgs, tools=None, metadata={}, where="d.jsonl:1",
                                        index=0))
    # prompt = everything before the first trained token; the trailing user turn is response with mask 0
    assert [WORDS[t] for t in s.prompt_tokens][-3:] == ["<|im_end|>", "<|im_start|>", "assistant"]
    assert [WORDS[t] for t in s.response_tokens][:3] == ["it", "is", "42"]
    assert s.loss_mask.tolist() == [1, 1, 1, 1] + [0] * (len(s.response_tokens) - 4)
    assert s.reward == 0.0 and s.rollout_logprobs is None


def test_tiny_checkpoint_template_masks_the_reply(tmp_path: Path) -> None:
    """The chat template rlslurm/tiny.py writes (no end-of-turn token), loaded by AutoTokenizer."""
    from transformers import AutoTokenizer

    from rlslurm.tiny import tokenizer_json

    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    from rlslurm import tiny

    template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}" \
               "{% if add_generation_prompt %}assistant : {% endif %}"  # make_tiny_checkpoint's
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "chat_template": template}))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    conv = mask_conversation(tok, [{"role": "user", "content": "say digits"},
                                   {"role": "assistant", "content": "1 2 3"}])
    words = tiny.WORDS
    assert [words[t] for t, m in zip(conv.tokens, conv.loss_mask) if m] == ["1", "2", "3"]
    assert [words[t] for t in conv.tokens] == ["user", ":", "say", "digits", "assistant", ":", "1", "2", "3"]


def test_template_that_rewrites_history_is_refused_naming_the_record() -> None:
    tok = make_tokenizer(QWEN3_LIKE)
    # one assistant turn at the end: history is never re-rendered, so it works
    conv = mask_conversation(tok, CONV[:3])
    assert trained_text(tok, conv) == ["<think>", "</think>", "hello", "there", "<|im_end|>"]
    with pytest.raises(DataError) as e:
        mask_conversation(tok, CONV, where="conversations.jsonl:7")
    msg = str(e.value)
    assert msg.startswith("conversations.jsonl:7: chat template: messages[:3] does not render as a prefix")
    assert "\n" not in msg


def test_tokens_merged_across_a_turn_boundary_are_refused() -> None:
    tok = make_tokenizer(GLUED)
    with pytest.raises(DataError, match=r"^c.jsonl:2: the tokenizer merges text across a turn boundary"):
        mask_conversation(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}],
                          where="c.jsonl:2")


def test_records_that_are_not_conversations_are_refused() -> None:
    tok = make_tokenizer()
    with pytest.raises(DataError, match="list of {role, content} messages"):
        mask_conversation(tok, "hi", where="d.jsonl:1")
    with pytest.raises(DataError, match="no assistant token to train on"):
        sft_sample(tok, SimpleNamespace(messages=None, prompt=[{"role": "user", "content": "hi"}], tools=None,
                                        metadata={}, where="d.jsonl:4", index=3))
    with pytest.raises(DataError, match="^d.jsonl:5: messages\\[0\\] is an assistant turn"):
        mask_conversation(tok, [{"role": "assistant", "content": "hi"}], where="d.jsonl:5")


def _cfg(tmp_path: Path, **rollout) -> RunConfig:
    return RunConfig.model_validate({"rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 1, **rollout},
                                     "data": {"prompt_data": str(tmp_path / "c.jsonl"), "input_key": "messages"}})


def _ctx(cfg: RunConfig, source, tok):
    return SimpleNamespace(cfg=cfg, source=TrackedSource(source), tokenizer=tok, weight_version=0)


def test_rollout_function_builds_one_sample_per_conversation(tmp_path: Path) -> None:
    tok = make_tokenizer()
    lines = [json.dumps({"messages": CONV[1:3]}), json.dumps({"messages": CONV}), json.dumps({"messages": CONV[:3]})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    cfg = _cfg(tmp_path)
    src = PromptSource(tmp_path / "c.jsonl", input_key="messages", label_key=None, tokenizer=tok, shuffle=False)
    out = asyncio.run(generate_rollout(_ctx(cfg, src, tok)))
    assert [p.where for p in out.prompts] == [f"{tmp_path / 'c.jsonl'}:1", f"{tmp_path / 'c.jsonl'}:2"]
    assert [len(g) for g in out.groups] == [1, 1]
    s0, s1 = out.groups[0][0], out.groups[1][0]
    assert [WORDS[t] for t, m in zip(s1.response_tokens, s1.loss_mask) if m] == \
        ["hello", "there", "<|im_end|>", "fine", "thanks", "<|im_end|>"]
    assert s0.loss_mask.tolist() == [1, 1, 1]
    assert out.metrics["rollout/sft/trained_tokens"] == 9.0
    assert src.state_dict()["position"] == 2  # the cursor moved past exactly the two records used


def test_rollout_function_refuses_other_n_and_skips_bad_records_when_lenient(tmp_path: Path) -> None:
    tok = make_tokenizer()
    bad = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    good = json.dumps({"messages": CONV[1:3]})
    (tmp_path / "c.jsonl").write_text("\n".join([good, bad, good]) + "\n")
    src = lambda: PromptSource(tmp_path / "c.jsonl", input_key="messages", label_key=None, tokenizer=tok,
                               shuffle=False)
    with pytest.raises(ConfigError, match="--n-samples-per-prompt must be 1, got 4"):
        asyncio.run(generate_rollout(_ctx(_cfg(tmp_path, n_samples_per_prompt=4), src(), tok)))
    with pytest.raises(DataError, match=r"c.jsonl:2: no assistant token"):
        asyncio.run(generate_rollout(_ctx(_cfg(tmp_path), src(), tok)))
    cfg = _cfg(tmp_path)
    cfg.data.data_strict = False
    out = asyncio.run(generate_rollout(_ctx(cfg, src(), tok)))
    assert [p.index for p in out.prompts] == [0, 2] and out.metrics["rollout/sft/skipped"] == 1.0
    n = len(out.groups[0][0].tokens)
    with pytest.raises(DataError, match=rf"c.jsonl:1: the conversation has {n} tokens, more than "
                                        rf"--rollout-max-context-len {n - 1}"):
        asyncio.run(generate_rollout(_ctx(_cfg(tmp_path, rollout_max_context_len=n - 1), src(), tok)))
    with pytest.raises(ConfigError, match="no chat template"):
        asyncio.run(generate_rollout(_ctx(_cfg(tmp_path), src(), make_tokenizer(None))))


# ------------------------------------------------------------------ submit: --debug-train-only rules

def _hf(tmp_path: Path, template: str | None = None) -> Path:
    """An HF-shaped tiny-qwen3 directory with rlslurm/tiny.py's tokenizer and a chat template."""
    from rlslurm.tiny import tokenizer_json
    from tests.helpers.hf_shape import hf_shaped_dir

    hf = hf_shaped_dir(tmp_path / "hf", "tiny-qwen3")
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<eos>",
        "chat_template": template or ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> "
                                      "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")}))
    return hf


def _sft_argv(tmp_path: Path, records: list[list[dict]] | None = None, template: str | None = None) -> list[str]:
    data = tmp_path / "conversations.jsonl"
    records = records or [[{"role": "user", "content": "say digits"}, {"role": "assistant", "content": "1 2"}]] * 4
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    return ["--model", "tiny-qwen3", "--hf-checkpoint", str(_hf(tmp_path, template)), "--prompt-data", str(data),
            "--input-key", "messages", "--apply-chat-template", "--n-samples-per-prompt", "1",
            "--rollout-batch-size", "4", "--global-batch-size", "4", "--num-steps-per-rollout", "1",
            "--micro-batch-size", "1", "--num-rollout", "1", "--loss-type", "sft_loss", "--debug-train-only"]


def test_submit_resolves_sft_and_maps_slimes_rollout_function(tmp_path: Path) -> None:
    from rlslurm.resolve import resolve
    from rlslurm.rollout.main import builds_rollouts
    from rlslurm.rollout.sft import SFT_ROLLOUT_FN
    from rlslurm.settings.layout import no_engines_reason

    argv = _sft_argv(tmp_path)
    cfg = resolve(argv).cfg
    assert cfg.rollout.rollout_function_path == SFT_ROLLOUT_FN and cfg.builds_without_engines
    assert "--debug-train-only" in no_engines_reason(cfg) and builds_rollouts(cfg, 0) and not builds_rollouts(cfg, 1)
    slime = resolve(argv + ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout"]).cfg
    assert slime.rollout.rollout_function_path == SFT_ROLLOUT_FN
    # no engines: --device cpu needs no --engines-per-node
    assert resolve(argv + ["--device", "cpu", "--trainer-procs-per-node", "1"]).cfg.run.device == "cpu"


@pytest.mark.parametrize("extra,names", [
    (["--n-samples-per-prompt", "2", "--global-batch-size", "8"],
     ["--debug-train-only", "--n-samples-per-prompt must be 1"]),
    (["--loss-type", "policy_loss"], ["--debug-train-only", "--loss-type sft_loss"]),
    (["--eval-interval", "1", "--eval-prompt-data", "x", "DATA"], ["--debug-train-only", "eval"]),
    (["--verify-weight-sync"], ["--verify-weight-sync", "--debug-train-only"]),
    (["--debug-rollout-only"], ["--debug-train-only", "--debug-rollout-only"]),
    (["--custom-generate-function-path", "m:f"], ["--custom-generate-function-path", "--debug-train-only"]),
])
def test_submit_refuses_what_needs_engines_in_one_line(tmp_path: Path, extra: list[str], names: list[str]) -> None:
    from tests.helpers.config_errors import one_line_naming

    argv = _sft_argv(tmp_path)
    one_line_naming(argv + [str(tmp_path / "conversations.jsonl") if a == "DATA" else a for a in extra], *names)


def test_submit_refuses_sft_without_engines_flag_hf_or_a_maskable_record(tmp_path: Path) -> None:
    from tests.helpers.config_errors import one_line_naming

    argv = _sft_argv(tmp_path)
    one_line_naming([a for a in argv if a != "--debug-train-only"] +
                    ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout"],
                    "rlslurm.rollout.sft:generate_rollout", "add --debug-train-only")
    i = argv.index("--hf-checkpoint")
    one_line_naming(argv[:i] + argv[i + 2:], "--debug-train-only", "--hf-checkpoint")
    bad = [[{"role": "user", "content": "say digits"}, {"role": "assistant", "content": "1"}],
           [{"role": "user", "content": "say digits"}]]
    data = tmp_path / "conversations.jsonl"
    with pytest.raises(DataError, match=rf"^{data}:2: no assistant token to train on"):
        from rlslurm.resolve import resolve

        resolve(_sft_argv(tmp_path, bad * 2))
    qwen3_like = ("{% for m in messages %}{{ m['role'] }} : "
                  "{% if m['role'] == 'assistant' and loop.last %}( ) {% endif %}{{ m['content'] }} {% endfor %}"
                  "{% if add_generation_prompt %}assistant : {% endif %}")
    turns = [{"role": "user", "content": "say digits"}, {"role": "assistant", "content": "1"},
             {"role": "user", "content": "say letters"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match=rf"^{data}:1: chat template: messages\[:2\] does not render as a prefix"):
        resolve(_sft_argv(tmp_path, [turns] * 4, template=qwen3_like))


def test_import_slime_sft_script(tmp_path: Path) -> None:
    from rlslurm.slime_import import import_script

    script = tmp_path / "run-sft.sh"
    script.write_text("\n".join([
        "SFT_ARGS=(",
        "   --rollout-function-path slime.rollout.sft_rollout.generate_rollout",
        "   --prompt-data /data/conversations.jsonl",
        "   --input-key messages",
        "   --rollout-batch-size 16",
        "   --global-batch-size 16",
        "   --loss-type sft_loss",
        "   --loss-mask-type qwen3",
        "   --calculate-per-token-loss",
        "   --debug-train-only",
        ")",
        'python3 train.py ${SFT_ARGS[@]}', ""]))
    got = import_script(script, check=False)
    assert "--rollout-function-path rlslurm.rollout.sft:generate_rollout" in " ".join(got.argv)
    assert "--debug-train-only" in got.argv and "--loss-type" in got.argv
    dropped = dict(got.dropped)
    assert "--loss-mask-type" in dropped[8] and "chat template" in dropped[8]


# ------------------------------------------------------------------ the engine-free driver

def test_engine_free_driver_commits_sft_rollouts_paced_by_the_trainer_and_resumes(tmp_path: Path) -> None:
    """--debug-train-only's driver (no router, no engine) on a real run directory: it commits each SFT
    rollout with the data cursor, runs at most one rollout ahead of the version the trainer recorded,
    and a driver stopped while waiting resumes with every conversation served exactly once."""
    from rlslurm.buffer import RolloutReader, RunDir
    from rlslurm.buffer.control import Control
    from rlslurm.rollout.driver import RolloutDriver
    from rlslurm.rollout.sft import SFT_ROLLOUT_FN

    tok = make_tokenizer()
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"messages": CONV[1:3] if i % 2 else CONV}) + "\n" for i in range(8)))
    rd = RunDir.create(tmp_path / "run")
    cfg = RunConfig.model_validate({
        "rollout": {"num_rollout": 4, "rollout_batch_size": 2, "n_samples_per_prompt": 1,
                    "rollout_function_path": SFT_ROLLOUT_FN},
        "data": {"prompt_data": str(data), "input_key": "messages", "rollout_shuffle": False},
        "train": {"debug_train_only": True, "loss_type": "sft_loss"}})
    control = Control(rd)

    def driver() -> RolloutDriver:
        return RolloutDriver(cfg, rd, router_url=None, engine_urls=lambda: [], api_key=None, tokenizer=tok,
                             poll_s=0.02)

    async def until(pred, driver_task, timeout=20.0):
        for _ in range(int(timeout / 0.02)):
            if pred() or driver_task.done():
                return
            await asyncio.sleep(0.02)

    reader = RolloutReader(rd, readonly=True)

    async def first_attempt():
        stop = False
        task = asyncio.ensure_future(driver().run(lambda: stop))
        await until(lambda: reader.committed_ids() == [0, 1], task)
        await asyncio.sleep(0.3)
        assert reader.committed_ids() == [0, 1]  # rollout 2 waits for the trainer's version 1
        control.set_weight_version(1)
        await until(lambda: reader.committed_ids() == [0, 1, 2], task)
        await asyncio.sleep(0.3)
        stop = True  # while rollout 3 waits for version 2
        return await task

    first = asyncio.run(first_attempt())
    assert first.reason == "stopped" and first.committed == [0, 1, 2] and reader.committed_ids() == [0, 1, 2]
    control.set_weight_version(3)
    second = asyncio.run(driver().run())
    assert second.reason == "done" and second.committed == [3]
    served = [s.metadata["prompt_index"] for rid in range(4) for s in reader.read(rid).samples]
    assert served == list(range(8))  # each conversation once, in order, across the stop
    for rid in range(4):
        for s in reader.read(rid).samples:
            assert s.reward == 0.0 and s.loss_mask is not None and s.loss_mask[0] == 1
    assert control.engines() == []
