"""A small BPE tokenizer with a ChatML chat template and a tiny Llama, built and saved locally (nothing downloaded)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The capital of France is Paris.", "What is two plus two? Four.", "Say hello to the user politely.",
          "user assistant system: you are a helpful and concise model", "Hello there, how can I help you today?",
          "numbers one two three four five six seven eight nine ten", "Tell me a story about a cat and a dog."]


def make_tokenizer(chat_template: str | None = CHATML, vocab_size: int = 320):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on CORPUS; eos is ``<|im_end|>``, bos ``<s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                  unk_token="<unk>")
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def make_model_dir(path: Path, tok, *, layers: int = 2, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama with ``tok`` saved as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, tie_word_embeddings=False), **overrides})
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def chats(n: int) -> list[dict]:
    """``n`` short conversations of varying length, some multi-turn, some with a system prompt."""
    out = []
    for k in range(n):
        ms = [{"role": "system", "content": "you are concise"}] if k % 3 == 0 else []
        ms += [{"role": "user", "content": f"What is {k} plus two?"},
               {"role": "assistant", "content": f"It is {k + 2}." + " Four" * (k % 4)}]
        if k % 2:
            ms += [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there!"}]
        out.append({"messages": ms})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def word_tokenizer(d):
    """A word-level tokenizer of "<pad> <s> </s> <unk> what is two" saved into ``d``; returns ``d``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate("<pad> <s> </s> <unk> what is two".split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(d))
    return d


def assert_resumes(make, skip: int, check: int = 3) -> dict:
    """``make()`` -> a batch iterator with ``state_dict`` / ``load_state_dict``: past ``skip`` batches (past its
    first epoch), its state loaded into a fresh one gives the same next ``check`` batches. Returns the state."""
    a = make()
    for _ in range(skip):
        next(a)
    state = a.state_dict()
    assert state["epoch"] >= 1
    want = [next(a) for _ in range(check)]
    b = make()
    b.load_state_dict(state)
    for w in want:
        got = next(b)
        assert all(torch.equal(got[k], w[k]) for k in w)
    return state
