"""A small random model in a public model's folder layout, as transformers writes it
(config.json, model.safetensors) with a tokenizer.json beside it: what test_hf_import.py
imports, and the stand-in README's recipe runs where it downloads SmolLM2-135M.

    python tests/public_model.py FOLDER TOKENIZER.JSON     # a LlamaForCausalLM, as SmolLM2's
"""

import shutil
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
             tie_word_embeddings=True)


def public_model(folder: Path, config_class: str, tokenizer: Path | None = None, **settings):
    """A random transformers model of `config_class` (vocab 512 unless `tokenizer` sets it),
    norm gains perturbed (a gain of 1 hides a norm in the wrong place), saved by
    save_pretrained into `folder` with `tokenizer` beside it."""
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size() if tokenizer else 512
    config = getattr(transformers, config_class)(**{**SHAPE, "vocab_size": vocab, **settings})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    if tokenizer is not None:
        shutil.copy(tokenizer, Path(folder) / "tokenizer.json")
    return model


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    public_model(Path(sys.argv[1]), "LlamaConfig", Path(sys.argv[2]), rope_theta=100_000.0)
