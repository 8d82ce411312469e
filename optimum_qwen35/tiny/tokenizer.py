"""The tiny checkpoints' tokenizer: a small byte-level BPE trained on a fixed corpus, with Qwen3.5's special tokens at
the end of its vocabulary and the Qwen chat template (ChatML)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The Qwen3.5 special tokens, in the order the real tokenizer numbers them (after the byte-level BPE vocabulary).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# Tokens that are "special" (skipped by decode(skip_special_tokens=True)); the tool and think markers are not,
# as in the real tokenizer.
_NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

TINY_VOCAB_SIZE = 512
# The trained byte-level BPE has exactly this many entries (256 bytes + merges); special tokens follow.
TOKENIZER_BASE_VOCAB = TINY_VOCAB_SIZE - len(SPECIAL_TOKENS)


# The chat whose transformers reply the fixtures record (tests/fixtures/make_reference.py).
CHAT_MESSAGES = [{"role": "user", "content": "Give me a short introduction to large language models."}]


def special_token_id(token: str) -> int:
    """The id of a special token in the tiny tokenizer (fixed: the BPE vocabulary has a fixed size)."""
    return TOKENIZER_BASE_VOCAB + SPECIAL_TOKENS.index(token)


ENDOFTEXT_ID = special_token_id("<|endoftext|>")
IM_END_ID = special_token_id("<|im_end|>")

# The same pre-tokenization as the real Qwen3.5 tokenizer.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CORPUS = """\
The little harbor town woke up slowly. Fishermen pulled their boats onto the sand, and the smell of salt and
fresh bread drifted along the narrow streets. Children ran to school with their bags bouncing on their backs,
while the baker counted the loaves that were still warm from the oven.

A language model reads a sequence of tokens and predicts the next one. It learns which words tend to follow
other words, how sentences are built, and how a question is usually answered. When the model is small, it
makes many mistakes, but it can still be useful for testing the machinery that runs a much larger model.

Linear attention keeps a fixed-size state for every sequence instead of a cache that grows with each token.
The state is updated with a delta rule: the model writes a new value for a key, after removing the value that
the state already holds for that key. A gate decays the old state, so the memory can forget what it no longer
needs. Every fourth layer still uses full attention over all the previous tokens.

In the morning the weather was cold and grey, but by noon the sun had come out and the sea was bright and calm.
People sat outside the cafe, reading newspapers, drinking coffee and talking about the news of the day. An old
man fed the birds with crumbs, and a dog slept in the shade under a table.

Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 2024 and 3.14 are all tokens a model must handle. So are
punctuation marks like commas, periods, question marks? and exclamation marks! Code has its own shapes too:
def add(a, b): return a + b, and for i in range(10): print(i).

User: What is the capital of France? Assistant: The capital of France is Paris. User: Thank you for the help.
Assistant: You are welcome. Is there anything else you would like to know about the world, the weather or the
history of the old harbor town?
"""

# A Qwen-style ChatML template: `<|im_start|>role\ncontent<|im_end|>\n` per turn. `add_generation_prompt`
# opens the assistant turn; `enable_thinking=false` pre-fills an empty thinking block, as Qwen3.5 does.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- else -%}"
    "{%- set content = namespace(text='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set content.text = content.text + part['text'] -%}"
    "{%- elif part['type'] == 'image' -%}{%- set content.text = content.text + '<|vision_start|><|image_pad|><|vision_end|>' -%}"
    "{%- elif part['type'] == 'video' -%}{%- set content.text = content.text + '<|vision_start|><|video_pad|><|vision_end|>' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set content = content.text -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def build_tiny_tokenizer(path: str | os.PathLike, chat_template: str | None = None) -> Path:
    """Train a small byte-level BPE on an embedded corpus and save it, Qwen-style, into folder `path`.

    Writes `tokenizer.json` and `tokenizer_config.json` (ChatML `chat_template`, eos `<|im_end|>`, pad
    `<|endoftext|>`). With `chat_template` (a newer checkpoint family's, tiny/chat_templates.py), that template goes
    to `chat_template.jinja` instead, as the Qwen3.6 and Qwen3.8 snapshots ship it. The vocabulary has exactly `TOKENIZER_BASE_VOCAB` byte-level entries followed by the
    `SPECIAL_TOKENS` (512 in all). Deterministic. Loads with `transformers.AutoTokenizer` (4.57 and 5.x).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_BASE_VOCAB,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    if tok.get_vocab_size() != TOKENIZER_BASE_VOCAB:
        raise RuntimeError(
            f"the tiny BPE has {tok.get_vocab_size()} entries, expected {TOKENIZER_BASE_VOCAB}: the corpus is too short"
        )
    tok.add_special_tokens(
        [AddedToken(t, special=t not in _NON_SPECIAL, normalized=False, lstrip=False, rstrip=False) for t in SPECIAL_TOKENS]
    )
    for t in SPECIAL_TOKENS:
        got = tok.token_to_id(t)
        if got != special_token_id(t):
            raise RuntimeError(f"special token {t} got id {got}, expected {special_token_id(t)}")
    tok.save(str(path / "tokenizer.json"), pretty=True)

    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(special_token_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t not in _NON_SPECIAL,
            }
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": [
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ],
        "bos_token": None,
        **({} if chat_template is not None else {"chat_template": CHAT_TEMPLATE}),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(path / "tokenizer_config.json", tokenizer_config)
    stale = path / "chat_template.jinja"
    if chat_template is not None:
        stale.write_text(chat_template, encoding="utf-8")
    elif stale.exists():
        stale.unlink()
    return path


def _write_json(file: Path, obj) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
