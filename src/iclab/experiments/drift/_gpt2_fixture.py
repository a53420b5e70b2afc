"""A tiny random-init GPT-2 with a word-level tokenizer and tiny SST-2/MNLI-shaped datasets, to run the
drift.gpt2 pipeline where GPT-2's weights and GLUE are not available (tests; any offline machine):

    python -m iclab.experiments.drift._gpt2_fixture DIR
    iclab run drift.gpt2 --model-path DIR/model --data-path DIR/data

The sentences are random words with one sentiment word (SST-2: its label; MNLI: the hypothesis's),
so a model can in principle learn them; nothing here is meant to reproduce a number.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np



_WORDS = {"pos": ["good", "great", "fine", "nice", "fun"], "neg": ["bad", "dull", "poor", "awful", "boring"],
          "neutral": ["the", "movie", "film", "plot", "cast", "a", "was", "is", "very", "story", "man", "dog", "runs",
                      "sleeps", "park", "today"]}


def write_tiny_fixture(root: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random-init GPT-2 with a word-level tokenizer (``root/model``) and tiny SST-2/MNLI-shaped
    datasets (``root/data``). Returns (model_dir, data_dir). For tests and trying the pipeline offline."""
    import tokenizers
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    root = Path(root)
    model_dir, data_dir = root / "model", root / "data"
    rng = np.random.default_rng(seed)
    words = sorted({w for ws in _WORDS.values() for w in ws}
                   | {"Review", "Sentiment", "Premise", "Hypothesis", "Answer", ":", "negative", "positive", "yes",
                      "maybe", "no"})
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[EOS]")
    fast.save_pretrained(model_dir)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=512, vocab_size=len(vocab),
                                  bos_token_id=2, eos_token_id=2, pad_token_id=1)
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(model_dir)

    def sentence(kind):
        n = int(rng.integers(3, 7))
        body = list(rng.choice(_WORDS["neutral"], n))
        if kind:
            body.insert(int(rng.integers(0, n)), str(rng.choice(_WORDS[kind])))
        return " ".join(body)

    def write(path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    for split, n in (("train", 96), ("validation", 24)):
        labels = rng.integers(0, 2, n)
        write(data_dir / "sst2" / f"{split}.jsonl",
              [{"sentence": sentence("pos" if y else "neg"), "label": int(y)} for y in labels])
        name = "train" if split == "train" else "validation_matched"
        labels = rng.integers(0, 3, n)
        write(data_dir / "mnli" / f"{name}.jsonl",
              [{"premise": sentence(None), "hypothesis": sentence(["pos", None, "neg"][y]), "label": int(y)}
               for y in labels])
    return model_dir, data_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m iclab.experiments.drift._gpt2_fixture DIR", file=sys.stderr)
        sys.exit(2)
    m, d = write_tiny_fixture(sys.argv[1])
    print(f"model: {m}\ndata:  {d}\ntry:   iclab run drift.gpt2 --model-path {m} --data-path {d}")
