"""The `sim` engine's model folder: a byte-level tokenizer and a config, no weights.

The gateway serves every request through vLLM's own OpenAI serving layer
(gateway/openai_api.py), which needs a model config, a tokenizer and a chat
template even when the fleet runs the `sim` engine. This folder gives it one
whose tokenizer is the sim engine's: token id = UTF-8 byte value, `<|endoftext|>`
= 256 (EOS), `<think>`/`</think>` = 257/258, and a chat template that writes `<|role|>content` lines followed by
`<|assistant|>`. Prompt lengths stay one token per byte, as the sim's timing
model and the scheduling tests expect.

Written once under ~/.cache/skyline/models/ (no download, no weights: vLLM never
loads a model for it), in a folder per layout version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from skyline.core.envs import skyline_home

SIM_MODEL_DIR = "skyline-sim-bytes"
EOS_TOKEN = "<|endoftext|>"
EOS_ID = 256
# Reasoning markers (ids 257, 258), as reasoning models' tokenizers have them: the sim engine never
# emits them, but a gateway configured with a reasoning parser (e.g. deepseek_r1) finds them in the vocab.
THINK_TOKENS = ("<think>", "</think>")
_MARKER = ".skyline-sim-model"
_VERSION = 3  # 2: the newline as an expression (templates render with trim_blocks); 3: think tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] is not none %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def sim_model_dir() -> Path:
    """The folder (written on first use). Safe to call from concurrent processes: each version has
    its own folder, written aside and renamed into place, so no reader ever sees a folder change."""
    target = skyline_home() / "models" / f"{SIM_MODEL_DIR}-v{_VERSION}"
    if _complete(target):
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _write(tmp)
    (tmp / _MARKER).write_text(json.dumps({"version": _VERSION}))
    try:
        os.replace(tmp, target)
    except OSError:  # a concurrent process renamed its (identical) copy into place first
        _rmtree(tmp)
    return target


def _complete(target: Path) -> bool:
    try:
        return json.loads((target / _MARKER).read_text()).get("version") == _VERSION
    except (OSError, ValueError, AttributeError):
        return False


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of a byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _write(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # A BPE with no merges over the byte alphabet: every byte is one token, id = byte value.
    vocab = {ch: b for b, ch in _byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": None,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
    }, indent=2))
    # A Llama-shaped config vLLM accepts; nothing ever loads weights for it.
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": EOS_ID + 1 + len(THINK_TOKENS),
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "max_position_embeddings": 1 << 17, "eos_token_id": EOS_ID,
        "torch_dtype": "float32", "tie_word_embeddings": True,
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
