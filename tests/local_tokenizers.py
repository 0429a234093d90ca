"""Hugging Face tokenizers that exist on this machine without a Hub: trained here with the `tokenizers`
library on real text (Python's own documentation, as the demo corpus), saved as folders that
`transformers.AutoTokenizer` reads, exactly as a downloaded tokenizer would be."""

import os

BOS, EOS = "<s>", "</s>"


def training_text(limit=400):
    """Real English: the language-reference topics that ship with Python (pydoc_data)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[:limit]]


def bpe_folder(folder, vocab_size=2000, padding_tokens=0, bos=BOS, eos=EOS, sentencepiece_style=False):
    """A byte-level BPE of `vocab_size` merges and bytes trained on Python's docs, with BOS and EOS
    (either may be None) and `padding_tokens` ordinary added tokens before them, so the separators' ids
    can be pushed past 65,535 (a vocabulary that needs uint32 shards). `sentencepiece_style`: a BPE over
    characters with Metaspace's "▁" word boundary prepended to the text and digits split one by one, as
    Llama 2's and Mistral's tokenizers encode. Returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if sentencepiece_style:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        # Digits one by one, as SentencePiece's split_digits does for Llama 2 and Mistral
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
                                                     pre_tokenizers.Digits(individual_digits=True)])
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"], show_progress=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    tok.train_from_iterator(training_text(), trainer)
    if padding_tokens:
        tok.add_tokens([f"<pad_{i}>" for i in range(padding_tokens)])
    specials = [t for t in (bos, eos) if t]
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                 clean_up_tokenization_spaces=False)
    os.makedirs(folder, exist_ok=True)
    hf.save_pretrained(folder)
    return str(folder)
