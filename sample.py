"""Print completions of a prompt from an exported model, nanoGPT-style.

    python sample.py --export out/tiny/export --prompt "def " --max_new_tokens 64 \\
        --temperature 0.8 --top_k 50 --num_samples 2 --seed 1337

The export directory (written by `python export.py OUT_DIR`) holds the files sample.py
reads: model.pt (a Transformer state_dict), config.json (the StackConfig), tokenizer.json,
and tokenizer_config.json, whose eos_token is the end-of-text token that opened each
training document, and opens a completion too. (An export without tokenizer_config.json,
from before export.py wrote it, is read with <|endoftext|>; a public model's tokenizer
without that token needs the file.) It also holds provenance.json, where it came from,
which sample.py does not read. A missing or damaged export is one line on stderr and exit
status 2; --debug shows the traceback.

Imports from stacklm: cli, config, data (the end-of-text token of stacklm's own tokenizers),
devices and model.
"""

import argparse
import json
import pickle
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer

from config import StackConfig
from data import EOS_TOKEN
from model import TEMPERATURE, TOP_K, Transformer, complete
from plumbing.cli import ArgumentParser, user_errors
from plumbing.devices import DEVICES

# What sampling needs of every export; tokenizer_config.json is read where it is there
# (end_of_text). export.py also writes provenance.json, for people.
EXPORT_FILES = ("model.pt", "config.json", "tokenizer.json")


def load_export(export_dir: str, device: str = "cpu") -> tuple[Transformer, Tokenizer, int]:
    """The exported model, in eval mode on `device`, its tokenizer and the id of its
    end-of-text token. Raises ValueError or FileNotFoundError naming the file and how to
    write a good export."""
    export = Path(export_dir)
    if not export.is_dir():
        raise FileNotFoundError(f"--export {export}: no such directory; "
                                f"{how_to_export(export)}")
    missing = [name for name in EXPORT_FILES if not (export / name).is_file()]
    if missing:
        raise FileNotFoundError(f"--export {export} has no {', '.join(missing)} (sampling "
                                f"needs {', '.join(EXPORT_FILES)}); {how_to_export(export)}")
    try:
        saved = json.loads((export / "config.json").read_text(encoding="utf-8"))
        cfg = StackConfig.from_saved(saved)
    except (ValueError, TypeError) as e:  # bad JSON, an unknown or a bad field
        raise ValueError(f"{export / 'config.json'} is not a model config ({e}); "
                         f"{how_to_export(export)}") from e
    model = Transformer(cfg)
    try:
        with warnings.catch_warnings():  # a raw pickle's protocol is noise beside the refusal
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            # weights_only: a checkpoint is data; unpickling arbitrary objects would run code.
            state = torch.load(export / "model.pt", map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{export / 'model.pt'} holds objects other than tensors, so it was "
                         f"refused unread (unpickling them could run code; never load it with "
                         f"weights_only=False unless you trust its author); "
                         f"{how_to_export(export)}") from e
    except (RuntimeError, EOFError, KeyError) as e:  # not a torch.save file, or truncated
        raise ValueError(f"{export / 'model.pt'} is not a readable torch.save file "
                         f"({first_line(e)}); {how_to_export(export)}") from e
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError) as e:  # other names or shapes; not a dict at all
        raise ValueError(f"{export / 'model.pt'} does not fit {export / 'config.json'} "
                         f"({first_line(e)}); {how_to_export(export)}") from e
    try:
        tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{export / 'tokenizer.json'} is not a tokenizer ({e}); "
                         f"{how_to_export(export)}") from e
    return model.to(device).eval(), tokenizer, end_of_text(export, tokenizer)


def end_of_text(export: Path, tokenizer: Tokenizer) -> int:
    """The id of the token that opened each training document: the eos_token of the
    export's tokenizer_config.json; without that file, EOS_TOKEN, where the tokenizer has
    it."""
    path = export / "tokenizer_config.json"
    try:
        token = json.loads(path.read_text(encoding="utf-8"))["eos_token"] if path.is_file() \
            else EOS_TOKEN
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} names no eos_token ({type(e).__name__}: {e}); "
                         f"{how_to_export(export)}") from None
    token = token.get("content") if isinstance(token, dict) else token  # transformers' form
    eos_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
    if eos_id is None and path.is_file():
        raise ValueError(f"{path}: eos_token {token!r} is not a token of "
                         f"{export / 'tokenizer.json'}; {how_to_export(export)}")
    if eos_id is None:
        raise FileNotFoundError(f"--export {export} has no tokenizer_config.json, which names "
                                f"the end-of-text token of a tokenizer without {EOS_TOKEN!r}, "
                                f"as a public model's; {how_to_export(export)}")
    return eos_id


def checked_device(name: str) -> str:
    """--device: auto takes what training's --device=auto takes (a CUDA GPU, else an Apple
    GPU, else the CPU); a device torch does not know, or one this machine lacks, is refused
    in one line (torch.load would blame the export for it)."""
    if name == "auto":
        return next(device for device, (present, _) in DEVICES.items() if present())
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name} is not a device torch knows; use auto, cpu, cuda "
                         f"(cuda:N) or mps") from None
    if device.type in DEVICES and not DEVICES[device.type][0]():
        raise ValueError(f"--device {name}: this machine has no {DEVICES[device.type][1]}; "
                         f"use --device auto or cpu")
    return name


def first_line(error: Exception) -> str:
    """An error's type and first line: torch's messages run to paragraphs."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def how_to_export(export: Path) -> str:
    """The fix for any bad export: write it again from the run's newest checkpoint (the
    export takes the model's shape and tokenizer from the checkpoint itself)."""
    out_dir = export.parent if export.name == "export" else Path("OUT_DIR")
    return f"write one with: python export.py {out_dir}, which writes {out_dir / 'export'}"


def main(argv=None):
    parser = ArgumentParser(description="Sample completions from an exported model.",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--export", required=True, help="directory written by export.py")
    parser.add_argument("--prompt", default="\n", help="text to complete")
    parser.add_argument("--max_new_tokens", type=int, default=128,
                        help="tokens generated after the prompt")
    parser.add_argument("--temperature", type=float, default=TEMPERATURE, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=TOP_K,
                        help="sample among the k likeliest tokens, as the end-of-run sample "
                             "does; 0 = no top-k filter")
    parser.add_argument("--num_samples", type=int, default=3, help="completions to print")
    parser.add_argument("--seed", type=int, default=1337, help="seeds the sampling")
    parser.add_argument("--device", default="auto",
                        help="where the model runs: auto (a CUDA GPU, else an Apple GPU, else "
                             "the CPU), cuda, cuda:N, mps or cpu")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error, not just its message")
    args = parser.parse_args(argv)
    with user_errors(args.debug):  # a bad export: one line, no traceback
        torch.manual_seed(args.seed)
        model, tokenizer, eos_id = load_export(args.export, checked_device(args.device))
        for _ in range(args.num_samples):
            print(complete(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                           args.top_k or None, eos_id=eos_id))
            print("---------------")


if __name__ == "__main__":
    main()
