"""A word-level tokenizer with a chat template, built in memory (no hub), and a multi-turn conversation:
what the SFT tests (test_sft.py) and others that drive an engine-free rollout need."""

from __future__ import annotations

import json

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = SPECIAL + ["system", "user", "assistant", "tool", "be", "brief", "hi", "hello", "there", "how", "are",
                   "you", "fine", "thanks", "call", "f", "result", "42", "it", "is", "ok", "<think>", "</think>",
                   "hmm", "assistant:hi"]
CHATML = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
# Qwen3's habit: the last assistant turn carries an (empty) think block, earlier ones do not

def make_tokenizer(chat_template: str | None = CHATML):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(SPECIAL)],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(WORDS)}, "unk_token": "<unk>"},
    }
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>",
                                  pad_token="<pad>")
    tok.chat_template = chat_template
    return tok

CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello there"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine thanks"},
]
