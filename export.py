"""Export a checkpoint as files other programs load: sample.py's folder, or a Hugging Face
transformers folder (what lm-evaluation-harness, lighteval, vLLM and the Hub load).

    python export.py out/tiny                      # out/tiny/export/ from the newest checkpoint
    python export.py out/tiny --format hf          # out/tiny/export-hf/
    python export.py out/tiny --resume out/tiny/ckpt/step_0000200   # a chosen checkpoint

The export is the checkpoint's own model: its shape comes from the checkpoint's
train_state.json, and its tokenizer from the data it was trained on, checked against the
sha256 the checkpoint recorded (a data directory prepared again at the same path is
refused; --data_dir points at a copy of the original). Both folders carry
provenance.json: the checkpoint, its step and the code revisions that trained and
exported it.

`--format stacklm` writes OUT_DIR/export/ with model.pt (one consolidated state dict,
whatever the rank count that trained it), config.json (the StackConfig), tokenizer.json
with tokenizer_config.json (the end-of-text token its data used) and provenance.json,
which sample.py loads.

`--format hf` writes OUT_DIR/export-hf/. Which transformers class reads it depends on the
shape (model.py's blocks match these to ~1e-6; a model imported with --init_from goes back
as the class it came from):

    neither                      LlamaForCausalLM      (SmolLM and SmolLM2 are this)
    QK-norm, no NoPE layers      Qwen3ForCausalLM      (per-head q/k RMSNorm before RoPE)
    NoPE layers, no QK-norm      SmolLM3ForCausalLM    (its no_rope_layers say which layers
                                                        rotate, by stacklm's own rule)
    QK-norm and NoPE layers      StackLMForCausalLM    (no stock class has both: a Qwen3
                                                        subclass in modeling_stacklm.py,
                                                        loaded with trust_remote_code=True)

The last names its own model_type, `stacklm`, so a tool that ignores remote code refuses
the folder instead of running it as plain Qwen3, which would rotate the NoPE layers (its
logits are off by ~0.16). The folder holds config.json (with rope_theta and
rope_parameters, which transformers 4.57 and 5 read respectively), generation_config.json,
model.safetensors (the tied embedding written once), and a tokenizer that 4.57 and 5 load.

Every file is written into a scratch folder beside the export's (`export.tmp`,
`export-hf.tmp`); when all are written, each replaces the file of its name in the export's
folder. An export replaces the files its format writes (STACKLM_FILES, HF_FILES: an
earlier export's, or a file of that name), removes one of them that this export does not
write (modeling_stacklm.py, for a shape that needs none), and touches nothing else in the
folder: what a user keeps there (lm-eval's results, a model card) stays.

Imports from stacklm: checkpoint, cli, config, hf_import, log, model and shards: it composes
them.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from config import StackConfig, parse_mixture
from model import Transformer
from plumbing import checkpoint, hf_import, log, shards
from plumbing.cli import ArgumentParser, user_errors

MODELING_FILE = Path(__file__).resolve().parent / "plumbing" / "hf_modeling_stacklm.py"
# The files each format writes: the only ones an export replaces or removes in its folder.
STACKLM_FILES = ("model.pt", "config.json", "tokenizer.json", "tokenizer_config.json",
                 "provenance.json")
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "modeling_stacklm.py",
            "provenance.json")


def export(out_dir, fmt: str = "stacklm", resume: str = "latest",
           data_dir: str | None = None) -> Path:
    """out_dir/export/ (fmt "stacklm") or out_dir/export-hf/ (fmt "hf") from the checkpoint
    `resume` names (latest: the newest in out_dir). The tokenizer is read from the
    checkpoint's data_dir, or from `data_dir` if given (the data moved)."""
    check_run_folder(Path(out_dir))
    ckpt = checkpoint.find(out_dir, resume)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoint.ckpt_root(out_dir)} to export; "
                                f"train first, or pass --resume PATH to a checkpoint folder")
    folder = Path(out_dir) / ("export-hf" if fmt == "hf" else "export")
    check_folder(folder, HF_FILES if fmt == "hf" else STACKLM_FILES)
    try:
        state = checkpoint.read_train_state(ckpt)
        model_cfg = checkpoint_model(ckpt, state)
        source = parse_mixture(data_dir or state["config"]["data_dir"])[0][0]  # one tokenizer
        tokenizer = trained_tokenizer(ckpt, state, source, given=data_dir is not None)
        weights = checkpoint.read_model(ckpt, Transformer(model_cfg))
    except checkpoint.DamagedCheckpointError as e:
        raise checkpoint.DamagedCheckpointError(f"{e}; {another_checkpoint(out_dir, ckpt)}") \
            from None
    provenance = {"checkpoint": str(ckpt), "step": state["step"],
                  "trained_by": state["revision"], "exported_by": log.code_revision()}
    eos_id = shards.load_manifest(source)["eos_id"]  # each training document opened with it
    if fmt == "hf":
        out = write_hf(folder, weights, model_cfg, tokenizer, eos_id, provenance)
        remote = ", trust_remote_code=True" if needs_remote_code(model_cfg) else ""
        print(f"exported {ckpt} to {out} as {architecture(model_cfg)}; load it with "
              f"transformers' AutoModelForCausalLM.from_pretrained({str(out)!r}{remote})")
        return out
    out = write_stacklm(folder, weights, model_cfg, tokenizer, eos_id, provenance)
    print(f"exported {ckpt} to {out}; try: python sample.py --export {out}")
    return out


def check_run_folder(out_dir: Path):
    """OUT_DIR is a run's folder (it holds ckpt/), not one of its checkpoints: an export
    written inside a checkpoint would go when pruning deletes that checkpoint."""
    if (out_dir / "train_state.json").is_file():
        run = out_dir.parent.parent if out_dir.parent.name == "ckpt" else Path("OUT_DIR")
        raise ValueError(f"{out_dir} is a checkpoint, not a run's out_dir; export it with "
                         f"`python export.py {run} --resume {out_dir}`")


def another_checkpoint(out_dir, ckpt: Path) -> str:
    """The fix for a checkpoint that cannot be read: export the newest other one."""
    others = [p for p in checkpoint.complete_checkpoints(out_dir) if p.resolve() != ckpt.resolve()]
    if not others:
        return "restore the file; this run has no other checkpoint to export"
    return f"export another checkpoint: `python export.py {out_dir} --resume {others[-1]}`"


def checkpoint_model(ckpt: Path, state: dict) -> StackConfig:
    """The model shape the checkpoint was trained with, from its train_state.json."""
    try:
        return StackConfig.from_saved(state["config"]["model"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{ckpt}/train_state.json holds no readable model config "
                         f"({type(e).__name__}: {e}); export a checkpoint this trainer "
                         f"wrote") from None


def trained_tokenizer(ckpt: Path, state: dict, data_dir: str, given: bool) -> str:
    """data_dir's tokenizer file, after checking it is the one checkpoint `ckpt` was trained
    with: a directory prepared again at the same path, or another corpus `given` as
    --data_dir, must not slip another in. A checkpoint from before mixtures recorded only
    the data's whole fingerprint."""
    trained_on = parse_mixture(state["config"]["data_dir"])[0][0]
    if given and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"--data_dir {data_dir} does not exist; pass the folder the "
                                f"data {ckpt} trained on ({trained_on}) was moved or copied to")
    path = shards.tokenizer_path(data_dir)  # the file matches data_dir's own manifest
    manifest = shards.load_manifest(data_dir)
    if state["tokenizer_sha256"] is not None:
        same = manifest["tokenizer"]["sha256"] == state["tokenizer_sha256"]
    else:
        same = shards.fingerprint(manifest) == state.get("data_sha256")
    if same:
        return path
    if given:
        raise ValueError(f"--data_dir {data_dir}: {path} is not the tokenizer {ckpt} was "
                         f"trained with (it trained on {trained_on}); pass --data_dir a copy "
                         f"of {trained_on} as it was, or drop --data_dir if {trained_on} is "
                         f"unchanged")
    raise ValueError(f"{path} is not the tokenizer {ckpt} was trained with ({data_dir} "
                     f"was prepared again since); restore that data directory, or pass "
                     f"--data_dir a copy that holds the original tokenizer")


def check_folder(folder: Path, names: tuple[str, ...]):
    """Before any work: the export's folder and its scratch folder must be folders (or
    absent), and a scratch folder a killed export left must hold the export's files alone,
    for they go."""
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file, not the folder export.py writes; move "
                                 f"it elsewhere")
    scratch = scratch_of(folder)
    if scratch.exists() and not scratch.is_dir():
        raise NotADirectoryError(f"{scratch} is a file, where export.py writes its scratch "
                                 f"folder; move it elsewhere")
    others = sorted(p.name for p in scratch.iterdir() if p.name not in names) \
        if scratch.is_dir() else []
    if others:
        raise ValueError(f"{scratch} is export.py's scratch folder, and holds files an export "
                         f"does not write ({', '.join(others)}); move them elsewhere")


def scratch_of(folder: Path) -> Path:
    return folder.with_name(folder.name + ".tmp")


def write_folder(folder: Path, names: tuple[str, ...], write) -> Path:
    """Call write(tmp) on an empty scratch folder beside `folder`, then move each file it
    wrote into `folder`, replacing the file of that name; one of `names` (the format's
    files) it did not write is removed from `folder`. Any other file there is left as it
    is: a user's, never the export's. check_folder vetted both folders."""
    tmp = scratch_of(folder)
    if tmp.is_dir():  # a killed export's: its files go
        for name in names:
            (tmp / name).unlink(missing_ok=True)
        tmp.rmdir()
    tmp.mkdir(parents=True)
    write(tmp)
    folder.mkdir(exist_ok=True)
    for name in names:
        if (tmp / name).exists():
            os.replace(tmp / name, folder / name)
        else:
            (folder / name).unlink(missing_ok=True)
    tmp.rmdir()
    return folder


def write_stacklm(folder: Path, weights: dict, cfg: StackConfig, tokenizer_file, eos_id: int,
                  provenance: dict) -> Path:
    """sample.py's folder: model.pt, config.json, tokenizer.json with tokenizer_config.json
    (its end-of-text token), provenance.json."""
    def write(tmp: Path):
        torch.save(weights, tmp / "model.pt")
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1),
                                         encoding="utf-8")
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=1), encoding="utf-8")
        shutil.copy(tokenizer_file, tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": token_of(tokenizer_file, eos_id)}, indent=1), encoding="utf-8")
    return write_folder(folder, STACKLM_FILES, write)


# ---------------------------------------------------------------------------------------
# The transformers folder
# ---------------------------------------------------------------------------------------

def architecture(cfg: StackConfig) -> str:
    """The transformers class that computes what this shape computes (hf_import.FAMILIES
    reads each back)."""
    if not cfg.qk_norm:
        return "SmolLM3ForCausalLM" if cfg.nope_every else "LlamaForCausalLM"
    return "StackLMForCausalLM" if cfg.nope_every else "Qwen3ForCausalLM"


def needs_remote_code(cfg: StackConfig) -> bool:
    return architecture(cfg) == "StackLMForCausalLM"


def hf_config(cfg: StackConfig, eos_id: int, revision: str) -> dict:
    """config.json for `architecture(cfg)`; the EOS id is also BOS and padding, as in
    training, where EOS opens every document."""
    arch = architecture(cfg)
    config = {
        "architectures": [arch], "model_type": {"LlamaForCausalLM": "llama",
                                                 "Qwen3ForCausalLM": "qwen3",
                                                 "SmolLM3ForCausalLM": "smollm3",
                                                 "StackLMForCausalLM": "stacklm"}[arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_size, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "use_sliding_window": False,
        # 4.57 reads rope_theta, 5.x rope_parameters: both, or one of them trains on 10,000
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
        "torch_dtype": "float32", "stacklm_revision": revision,
    }
    if cfg.nope_every:
        config["no_rope_layers"] = hf_import.no_rope_layers(cfg.n_layers, cfg.nope_every)
    if needs_remote_code(cfg):
        config["auto_map"] = {"AutoConfig": "modeling_stacklm.StackLMConfig",
                              "AutoModelForCausalLM": "modeling_stacklm.StackLMForCausalLM"}
    return config


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack's parameter names -> transformers' (hf_import.hf_name). The head is the
    embedding (tied): written once, as model.embed_tokens.weight, which transformers ties
    back."""
    return {hf_import.hf_name(name): tensor.detach().to(torch.float32).contiguous().clone()
            for name, tensor in state.items()}


def write_hf(folder, weights: dict, cfg: StackConfig, tokenizer_file, eos_id: int,
             provenance: dict, config: dict | None = None) -> Path:
    """The transformers folder. `config` replaces the derived config.json (the tests'
    negative controls use it)."""
    config = config or hf_config(cfg, eos_id, provenance["trained_by"])
    eos = token_of(tokenizer_file, eos_id)
    special = {"bos_token": eos, "eos_token": eos, "pad_token": eos}

    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
             "do_sample": True, "temperature": 0.8, "top_k": 50}, indent=1), encoding="utf-8")
        # "format": "pt" is what 4.57 asks of a safetensors file before it loads it
        save_file(hf_state_dict(weights), tmp / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(tokenizer_file, tmp / "tokenizer.json")
        # PreTrainedTokenizerFast loads in 4.57 and 5.x alike (5's TokenizersBackend does not)
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", **special,
             "model_max_length": cfg.max_seq_len}, indent=1), encoding="utf-8")
        (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=1),
                                                     encoding="utf-8")
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=1), encoding="utf-8")
        if config.get("auto_map"):
            shutil.copy(MODELING_FILE, tmp / "modeling_stacklm.py")
    return write_folder(Path(folder), HF_FILES, write)


def token_of(tokenizer_file, token_id: int) -> str:
    """The text of a token of the tokenizer in `tokenizer_file`."""
    return Tokenizer.from_file(str(tokenizer_file)).id_to_token(token_id)


def main(argv=None):
    parser = ArgumentParser(
        description="Export a training checkpoint: OUT_DIR/export/ for sample.py, or "
                    "OUT_DIR/export-hf/ for transformers.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the run's out_dir (holds ckpt/)")
    parser.add_argument("--format", choices=("stacklm", "hf"), default="stacklm",
                        help="stacklm: OUT_DIR/export/ for sample.py; hf: OUT_DIR/export-hf/, "
                             "a Hugging Face transformers folder")
    parser.add_argument("--resume", default="latest", metavar="PATH",
                        help="the checkpoint folder to export; latest: the newest in OUT_DIR")
    parser.add_argument("--data_dir", default=None,
                        help="where the checkpoint's data (its tokenizer) now is, if it moved")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error, not just its message")
    args, unknown = parser.parse_known_args(argv)
    with user_errors(args.debug):
        if unknown:
            raise ValueError(not_an_export_flag(unknown[0]))
        export(args.out_dir, args.format, args.resume, args.data_dir)


def not_an_export_flag(flag: str) -> str:
    """Why export.py refuses a flag that train.py takes (or another unknown one)."""
    if flag.startswith("--model."):
        return (f"{flag}: export.py takes no model flags: the model's shape comes from the "
                f"checkpoint's own train_state.json, so nothing can describe its weights "
                f"wrongly; drop it")
    if flag.partition("=")[0] == "--force":
        return ("--force: export.py needs none: it replaces the files of its own earlier "
                "export, and no other file in the folder; drop it")
    return (f"unrecognized argument {flag}: export.py takes OUT_DIR, --format, --resume, "
            f"--data_dir and --debug (`export.py --help`)")


if __name__ == "__main__":
    main()
