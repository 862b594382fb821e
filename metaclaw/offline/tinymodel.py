"""A tiny causal language model and tokenizer, built locally from a config (no download).

The slow loop is tested and demonstrated offline on this model: it is small enough to sample and
train on a laptop CPU in seconds, yet it is a real ``transformers`` Llama-architecture model with a
real ``tokenizers`` tokenizer and a chat template, loaded back with ``AutoModelForCausalLM`` and
``AutoTokenizer`` like any other Hugging Face model path.

    >>> from metaclaw.offline.tinymodel import write_tiny_model
    >>> path = write_tiny_model("/tmp/tiny")          # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(path)   # doctest: +SKIP

The tokenizer is word level over a small fixed vocabulary (words outside it become ``<unk>``), so
that a random-initialised model samples each word with a probability near 1/|V| and a toy task
such as "answer with the word yes" is learnable with GRPO in well under a minute.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: Special tokens. ``<|end|>`` closes every chat message and is the end-of-sequence token.
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|tool|>"]

#: The ordinary words of the vocabulary (kept small on purpose; see the module docstring).
WORDS = [
    "yes", "no", "maybe", "hello", "hi", "please", "say", "answer", "the", "a", "word", "is",
    "ok", "done", "what", "how", "why", "you", "i", "it", "tool", "call", "result", "weather",
    "time", "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "red", "green", "blue", "cat", "dog", "sun", "moon", "good", "bad", "thanks", "help",
    "{", "}", ":", ",", '"', ".", "?", "!", "name", "arguments", "<tool_call>", "</tool_call>",
]

#: A simple chat template: the offered tools' names (if any) as a first system line, then
#: ``<|role|> content <|end|>`` per message, then ``<|assistant|>``.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|> tool' }}{% for tool in tools %}"
    "{{ ' ' + (tool['function']['name'] if tool['function'] is defined else tool['name']) }}"
    "{% endfor %}{{ ' <|end|> ' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + (message['content'] or '') + ' <|end|> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` over :data:`SPECIAL_TOKENS` + :data:`WORDS`, with the chat
    template set. Deterministic: the same ids on every call."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    # Split on whitespace, and split off punctuation so JSON-ish text maps onto known tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(pattern=Regex(r'[{}:,".?!]'), behavior="isolated"),
    ])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|end|>",
        bos_token=None, model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_model(directory: str | os.PathLike[str], seed: int = 0, *, hidden_size: int = 64,
                     num_layers: int = 2) -> Path:
    """Create the tiny model and tokenizer in ``directory`` and return its path.

    In: a directory (created if needed), a seed for the weight initialisation. Out: the path,
    loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
    The same seed always yields byte-identical weights. The unembedding is untied from the
    embedding so LoRA can adapt it (as Tinker's ``train_unembed`` does).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None)
    cpu_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(cpu_state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a 1-shard model
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "metaclaw_tiny.json").write_text(json.dumps({"seed": seed, "kind": "tiny-llama"}))
    return path
