"""Print completions of a prompt from an exported model, nanoGPT-style.

    python sample.py --export out/tiny/export --prompt "def " --max_new_tokens 64 \\
        --temperature 0.8 --top_k 50 --num_samples 2 --seed 1337

The export directory (written by `python train.py --export`) holds model.pt (a
Transformer state_dict), config.json (the StackConfig) and tokenizer.json.
"""

import argparse
import json
import os

import torch
from tokenizers import Tokenizer

from config import StackConfig
from data import EOS_TOKEN
from model import Transformer


def load_export(export_dir: str, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    """The exported model, in eval mode on `device`, and its tokenizer."""
    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = StackConfig(**json.load(f))
    model = Transformer(cfg)
    # weights_only: a checkpoint is data; unpickling arbitrary objects would run code.
    state = torch.load(os.path.join(export_dir, "model.pt"), map_location=device,
                       weights_only=True)
    model.load_state_dict(state)
    tokenizer = Tokenizer.from_file(os.path.join(export_dir, "tokenizer.json"))
    return model.to(device).eval(), tokenizer


def complete(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
             top_k: int | None) -> str:
    """One completion of `prompt`, cut at the first end-of-text the model generates."""
    eot = tokenizer.token_to_id(EOS_TOKEN)
    ids = [eot] + tokenizer.encode(prompt).ids
    device = model.embed.weight.device
    tokens = model.generate(torch.tensor([ids], device=device), max_new_tokens,
                            temperature=temperature, top_k=top_k)[0].tolist()
    new = tokens[len(ids):]
    if eot in new:
        new = new[:new.index(eot)]
    return tokenizer.decode(ids[1:] + new)


def main():
    parser = argparse.ArgumentParser(description="Sample completions from an exported model.")
    parser.add_argument("--export", required=True, help="directory written by train.py --export")
    parser.add_argument("--prompt", default="\n", help="text to complete")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=200, help="0 = no top-k filter")
    parser.add_argument("--num_samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model, tokenizer = load_export(args.export, args.device)
    for _ in range(args.num_samples):
        print(complete(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                       args.top_k or None))
        print("---------------")


if __name__ == "__main__":
    main()
