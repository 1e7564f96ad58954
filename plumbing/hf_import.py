"""Start from a public model: a transformers folder (config.json, safetensors weights and,
for its data, tokenizer.json) as a run's starting weights, `--init_from=DIR` (torchtitan's
checkpoint.initial_load_path with initial_load_in_hf).

The families whose blocks are stacklm's blocks, and what each sets in StackConfig:

    LlamaForCausalLM     SmolLM, SmolLM2      no QK-norm, RoPE on every layer
    Qwen3ForCausalLM     Qwen3                QK-norm, RoPE on every layer
    SmolLM3ForCausalLM   SmolLM3              no QK-norm, NoPE layers (no_rope_layers)
    StackLMForCausalLM   stacklm's export     QK-norm and NoPE layers

`model_shape` maps config.json onto StackConfig's fields, and refuses in one line, naming the
field and its value, what StackConfig cannot express: untied embeddings, RoPE scaling,
biases, sliding windows, another activation, NoPE layers that are not every N-th; and a
config.json cut off, or lacking a field the shape needs. `check_weights` reads the
safetensors headers alone, before any work: a file cut short, a shard the index names but
the folder lacks, a weight missing or of another shape than config.json's is refused (the
fix for a damaged download: download it again). Every one of the model's tensors must be
found, with its shape: a missing one is an error, never left at its initial value.
`read_weights` then reads the weights with the safetensors library (nothing is unpickled;
a folder of pickles is refused with the command that converts it) as fp32 master weights,
whatever dtype the download holds; resume.py puts them into a fresh run's model (sharded
or not). transformers rotates the two halves of each head (`rotate_half`), as
model.apply_rope does, so the weights need no q/k permutation; nor are there RoPE buffers
to load: model.py computes the rotation from the positions. tests/test_hf_import.py checks
the logits against transformers' own.

Imports from stacklm: model (the names and shapes of a model's weights) and shards (a
prepared folder's manifest).
"""

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from model import Transformer
from plumbing import shards

# Architecture -> (qk_norm, has no_rope_layers, transformers' default rope_theta).
FAMILIES = {"LlamaForCausalLM": (False, False, 10_000.0),
            "Qwen3ForCausalLM": (True, False, 10_000.0),
            "SmolLM3ForCausalLM": (False, True, 2_000_000.0),
            "StackLMForCausalLM": (True, True, 10_000.0)}

# transformers' module names -> stacklm's, in a block (model.layers.N.<name>: blocks.N.<name>)
BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
               "self_attn": "attn", "mlp": "mlp"}

# config.json's fields the shape is read from that have no default: every transformers
# config of these families writes them
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings")
DOWNLOAD_AGAIN = "download it again"  # the fix for a file a download cut short or damaged


def read_config(folder) -> dict:
    path = Path(folder) / "config.json"
    if Path(folder).is_file():  # tab completion's config.json, say
        raise NotADirectoryError(f"init_from={folder} is a file; pass the folder that holds "
                                 f"it: --init_from={Path(folder).parent}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"init_from={folder}: no config.json there; point it at a "
                                f"transformers folder (config.json and *.safetensors)") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not JSON ({e}): cut off or damaged; "
                         f"{DOWNLOAD_AGAIN}") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a transformers config (a JSON object)")
    return config


def model_shape(folder) -> dict:
    """StackConfig's fields for the model in `folder`, from its config.json."""
    config, path = read_config(folder), Path(folder) / "config.json"
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in FAMILIES:
        raise ValueError(f"{path}: architectures {config.get('architectures')} is not one whose "
                         f"blocks stacklm's are ({', '.join(FAMILIES)}); {ELSEWHERE}")
    qk_norm, nope_layers, default_theta = FAMILIES[architecture]
    refuse_what_stacklm_cannot_express(config, path)
    check_fields(config, path)
    width, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or width // heads
    rope = config.get("rope_parameters") or {}
    return {"vocab_size": config["vocab_size"], "d_model": width,
            "n_layers": config["num_hidden_layers"], "n_heads": heads,
            "n_kv_heads": config.get("num_key_value_heads") or heads,
            "intermediate": config["intermediate_size"],
            "max_seq_len": config["max_position_embeddings"],
            "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", default_theta))),
            "qk_norm": qk_norm, "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "head_dim": None if head_dim * heads == width else head_dim,
            "nope_every": nope_every(config, path) if nope_layers else 0}


# What a user can do with a model stacklm's blocks cannot hold.
ELSEWHERE = ("continue a model of those families with tied embeddings, plain RoPE, no biases, "
             "SwiGLU and full attention (SmolLM2, or a SmolLM3 or Qwen3 of that kind), or train "
             "this shape from scratch: drop --init_from and set --model.* flags")


def refuse_what_stacklm_cannot_express(config: dict, path: Path):
    """One line naming the first field whose value StackConfig has no knob for."""
    rope = config.get("rope_parameters") or {}
    layer_types = set(config.get("layer_types") or ["full_attention"])
    problems = [
        ("tie_word_embeddings", config.get("tie_word_embeddings", True) is not True,
         "StackConfig ties the head to the embedding"),
        ("rope_scaling", config.get("rope_scaling") not in (None, {}),
         "model.py's RoPE has no scaling"),
        ("rope_parameters.rope_type", rope.get("rope_type", "default") != "default",
         "model.py's RoPE has no scaling"),
        ("attention_bias", bool(config.get("attention_bias")), "stacklm's projections have no "
                                                                "bias"),
        ("mlp_bias", bool(config.get("mlp_bias")), "stacklm's projections have no bias"),
        ("use_sliding_window", bool(config.get("use_sliding_window")),
         "stacklm's attention sees the whole document"),
        ("layer_types", layer_types != {"full_attention"},
         "stacklm's attention sees the whole document"),
        ("hidden_act", config.get("hidden_act", "silu") != "silu", "stacklm's MLP is SwiGLU"),
    ]
    for field, refused, why in problems:
        if refused:
            value = config.get(field) if "." not in field else rope.get("rope_type")
            raise ValueError(f"{path}: {field}={json.dumps(value)}: {why}, so this model cannot "
                             f"be continued here; {ELSEWHERE}")


def check_fields(config: dict, path: Path):
    """The fields the shape is read from, each a positive whole number, and heads attention
    can use: in one line naming config.json and the field, not the model knob it sets (the
    user gave none). A field missing or wrong is a damaged file, not a model to continue."""
    for field in (*SHAPE_FIELDS, "num_key_value_heads", "head_dim"):
        value = config.get(field)
        if value is None and field in SHAPE_FIELDS:
            raise ValueError(f"{path} has no {field}, which the model's shape is read from; "
                             f"{DOWNLOAD_AGAIN}")
        if value is not None and (type(value) is not int or value <= 0):
            raise ValueError(f"{path}: {field}={json.dumps(value)} is not a positive whole "
                             f"number; {DOWNLOAD_AGAIN}")
    width, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, head_dim = config.get("num_key_value_heads") or heads, config.get("head_dim")
    if heads % kv_heads:
        raise ValueError(f"{path}: num_key_value_heads={kv_heads} does not divide "
                         f"num_attention_heads={heads}, as grouped-query attention needs; "
                         f"{DOWNLOAD_AGAIN}")
    if head_dim is None and width % heads:
        raise ValueError(f"{path}: hidden_size={width} is not divisible by "
                         f"num_attention_heads={heads}, and no head_dim says each head's "
                         f"width; {DOWNLOAD_AGAIN}")
    if (head_dim or width // heads) % 2:
        said = f"head_dim={head_dim}" if head_dim else \
            f"each head's width, hidden_size / num_attention_heads = {width // heads},"
        raise ValueError(f"{path}: {said} is odd, but RoPE rotates a head's dimensions in "
                         f"pairs, so no model of these families has such heads; "
                         f"{DOWNLOAD_AGAIN}")


def nope_every(config: dict, path: Path) -> int:
    """SmolLM3's no_rope_layers (1: the layer rotates) as stacklm's rule, every N-th layer
    without RoPE ((layer + 1) % N == 0); 0 where every layer rotates."""
    rotates = config.get("no_rope_layers") or [1] * config["num_hidden_layers"]
    for every in [0, *range(1, len(rotates) + 1)]:
        if rotates == no_rope_layers(len(rotates), every):
            return every
    raise ValueError(f"{path}: no_rope_layers={rotates} is not every N-th layer without RoPE, "
                     f"the only pattern model.nope_every expresses; {ELSEWHERE}")


def no_rope_layers(n_layers: int, nope_every: int) -> list[int]:
    """stacklm's rule (model.uses_rope) as SmolLM3's no_rope_layers: 1 where a layer rotates."""
    return [int(not nope_every or (i + 1) % nope_every != 0) for i in range(n_layers)]


def check_shape(cfg):
    """The run's model is the shape of cfg.init_from's config.json (a config made in code,
    not through the command line, may not be)."""
    for name, value in model_shape(cfg.init_from).items():
        if getattr(cfg.model, name) != value:
            raise ValueError(f"model.{name}={getattr(cfg.model, name)} disagrees with "
                             f"{cfg.init_from}/config.json ({name} {value}); give no model "
                             f"knob with --init_from: its config.json sets the shape")


# How docs/recipe.md continues a public model: AdamW, as such a model was pretrained, at a
# tenth of the from-scratch peak. On a stand-in (bench/continue_public.py) the from-scratch
# peaks made it forget about three times as much of its own data.
CONTINUE_AT = "--matrix_optimizer=adamw --adamw_peak_lr=3e-4"


def peak_warnings(cfg) -> list[str]:
    """A public model continued at a from-scratch peak (AdamW's, which the embedding always
    takes, or Muon's on the matrices): said in the banner, with the measured alternative."""
    scratch = type(cfg)()
    at_scratch = cfg.adamw_peak_lr == scratch.adamw_peak_lr or \
        cfg.matrix_optimizer == "muon" and cfg.muon_peak_lr == scratch.muon_peak_lr
    if not cfg.init_from or not at_scratch:
        return []
    return [f"warning: --init_from continues a pretrained model at the from-scratch peaks "
            f"(muon_peak_lr={cfg.muon_peak_lr:g}, adamw_peak_lr={cfg.adamw_peak_lr:g}); on a "
            f"stand-in they made it forget three times as much of its own data as a tenth "
            f"did; to keep what it knows, pass {CONTINUE_AT} (docs/recipe.md)"]


def check_tokenizer(cfg, source: str):
    """The data was prepared with the model's own tokenizer (the same file, by sha256), whose
    ids the model's vocabulary holds. Checked before the data's vocabulary is compared with
    the model's, whose fix (a model knob) --init_from refuses."""
    tokenizer = Path(cfg.init_from) / "tokenizer.json"
    if not tokenizer.is_file():
        raise FileNotFoundError(f"init_from={cfg.init_from} holds no tokenizer.json, so nothing "
                                f"says its data is tokenized as the model was; add the model's "
                                f"tokenizer.json there")
    ours = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    manifest = shards.load_manifest(source)
    if manifest["tokenizer"]["sha256"] != ours:
        raise ValueError(f"{source} was prepared with another tokenizer than {tokenizer}, so its "
                         f"token ids mean other words to this model; prepare it with the "
                         f"model's: python prepare.py --source CORPUS --tokenizer {tokenizer} "
                         f"--data_dir DIR")
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise ValueError(f"{cfg.init_from}/config.json: vocab_size={cfg.model.vocab_size:,} is "
                         f"below its own tokenizer.json's {manifest['vocab_size']:,} ids, so "
                         f"some of its tokens have no embedding: the folder's files disagree; "
                         f"{DOWNLOAD_AGAIN}")


def weight_files(folder) -> list[Path]:
    """The safetensors files of a transformers folder: one file, or the shards its index
    names. A folder of PyTorch pickles is refused: loading one runs whatever it holds."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted({str(name) for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not an index of safetensors files ({type(e).__name__}: "
                             f"{e}); {DOWNLOAD_AGAIN}") from None
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names {missing[0]}, which is not there "
                                    f"({len(missing)} of its {len(names)} files missing); "
                                    f"{DOWNLOAD_AGAIN}")
        return [folder / name for name in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
        raise ValueError(f"{folder} holds PyTorch pickles (*.bin), which stacklm does not load: "
                         f"unpickling one runs whatever it holds; convert it once with "
                         f"transformers: python -c \"from transformers import "
                         f"AutoModelForCausalLM as M; M.from_pretrained('{folder}')"
                         f".save_pretrained('{folder}-safetensors')\"")
    raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json, "
                            f"so no weights; {DOWNLOAD_AGAIN}, its *.safetensors with it")


def stacklm_name(name: str) -> str | None:
    """transformers' name of a weight -> stacklm's, or None for one the tied model does not
    hold (lm_head.weight: the embedding; a rotary inv_freq buffer: computed, not stored)."""
    if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    if name == "model.norm.weight":
        return "norm.weight"
    parts = name.split(".")  # model.layers.N.<module>.<...>
    if parts[:2] != ["model", "layers"] or len(parts) < 5 or parts[3] not in BLOCK_NAMES:
        return name  # unknown: load() names it
    return ".".join(["blocks", parts[2], BLOCK_NAMES[parts[3]], *parts[4:]])


def hf_name(name: str) -> str:
    """stacklm's name of a weight -> transformers' (the inverse of stacklm_name)."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    parts = name.split(".")  # blocks.N.<module>.<...>
    module = next(hf for hf, ours in BLOCK_NAMES.items() if ours == parts[2])
    return ".".join(["model", "layers", parts[1], module, *parts[3:]])


def read_header(path: Path) -> dict[str, tuple]:
    """Each tensor's shape in a safetensors file, from its header alone: 8 bytes (the
    header's length, little-endian), the header (JSON: each tensor's dtype, shape and byte
    range), then the tensors' bytes, to the file's end. A file cut short, as an interrupted
    download leaves it, is refused here, before any work, not where its tensors are read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        text = f.read(min(length, size))
    try:
        header = json.loads(text)
        header.pop("__metadata__", None)
        shapes = {name: tuple(entry["shape"]) for name, entry in header.items()}
        end = 8 + length + max((entry["data_offsets"][1] for entry in header.values()),
                               default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ValueError(f"{path} has no safetensors header that reads: not a safetensors "
                         f"file, or cut short; {DOWNLOAD_AGAIN}") from None
    if end != size:
        raise ValueError(f"{path} is cut short: {size:,} bytes, where its header describes "
                         f"{end:,}; {DOWNLOAD_AGAIN}")
    return shapes


def check_weights(folder, model_cfg):
    """From the safetensors headers alone (no tensor read): each weight of a model of
    `model_cfg` (config.json's shape) is in `folder`, with its shape, and nothing else is.
    A missing one is an error, never left at its initial value."""
    with torch.device("meta"):  # the names and shapes alone
        wanted = {name: tuple(p.shape) for name, p in Transformer(model_cfg).named_parameters()}
    found = set()
    for path in weight_files(folder):
        for name, shape in read_header(path).items():
            ours = stacklm_name(name)
            if ours is None:
                continue
            if ours not in wanted:
                raise ValueError(f"{path}: weight {name} has no place in a stacklm model of "
                                 f"this config.json's shape; {DOWNLOAD_AGAIN}")
            if shape != wanted[ours]:
                raise ValueError(f"{path}: weight {name} is {shape}, where config.json's "
                                 f"{shaped_by(ours, model_cfg)} make it {wanted[ours]}: "
                                 f"the weights are not this config.json's; {DOWNLOAD_AGAIN}")
            found.add(ours)
    missing = [hf_name(name) for name in wanted if name not in found]
    if missing:
        raise ValueError(f"{folder}: no weight {missing[0]} ({len(missing)} missing in all); "
                         f"is its config.json the one of these weights? {DOWNLOAD_AGAIN}")


def shaped_by(name: str, cfg) -> str:
    """The config.json fields whose values make the shape of weight `name` (stacklm's)."""
    head = f"head_dim {cfg.head_size}" if cfg.head_dim else \
        f"head_dim {cfg.head_size} (= hidden_size / num_attention_heads)"
    hidden = f"hidden_size {cfg.d_model}"
    heads = f"num_attention_heads {cfg.n_heads} × {head}, {hidden}"
    kv_heads = f"num_key_value_heads {cfg.n_kv_heads} × {head}, {hidden}"
    mlp = f"intermediate_size {cfg.intermediate}, {hidden}"
    return {"embed": f"vocab_size {cfg.vocab_size}, {hidden}", "q_proj": heads,
            "o_proj": heads, "k_proj": kv_heads, "v_proj": kv_heads, "q_norm": head,
            "k_norm": head, "gate_proj": mlp, "up_proj": mlp,
            "down_proj": mlp}.get(name.split(".")[-2], hidden)


def read_weights(folder, model_cfg) -> dict[str, torch.Tensor]:
    """The weights of `folder` by stacklm's names, as fp32 tensors (the model's master weights,
    whatever dtype the download holds), after `check_weights`."""
    check_weights(folder, model_cfg)
    weights = {}
    for path in weight_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                ours = stacklm_name(name)
                if ours is not None:
                    weights[ours] = f.get_tensor(name).float()
    return weights
