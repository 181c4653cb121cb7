"""Writes the vLLM tier's model: run by the vLLM venv's python (it has transformers and tokenizers),
not by the test's own, so the repository's venv needs neither.

    <vllm-venv>/bin/python tests/real/vllm_model.py DIR

A random-weight Llama (hidden 128, 2 layers, 4 heads, 2 KV heads, vocabulary 512, 4096 positions, tied
embeddings, float32) and a byte-level BPE tokenizer trained on the few lines below, saved with a chat
template. The special tokens' output rows are zero, so the model never
says `</s>` and answers run to max_tokens; the byte-level vocabulary makes
the model write incomplete UTF-8 now and then, which vLLM holds back as empty deltas (what real users of
real tokenizers meet with any non-ASCII text).
"""

from __future__ import annotations

import sys
from pathlib import Path

LINES = [
    "Say something. The quick brown fox jumps over the lazy dog.",
    "Write a long story about streams, tokens and proxies that keep going.",
    "Count from one to ten in words: one two three four five six seven eight nine ten.",
    "A warm token goes through the proxy to the client, 1000 answers a second.",
    "Every request has a prompt, a model and a budget of max tokens.",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if not loop.last or message['role'] != 'assistant' %}{{ eos_token + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def write(folder: Path, seed: int = 1234) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(LINES * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # a logit of 0 for the special tokens, below the best of 508 random ones: never said
        for token in (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, fast.unk_token_id):
            model.lm_head.weight[token].zero_()
    model.save_pretrained(folder, safe_serialization=True)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
