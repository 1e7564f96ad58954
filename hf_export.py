"""A Hugging Face transformers folder from a Stack model: what lm-evaluation-harness,
lighteval, vLLM and the Hub load.

    python train.py --export --format=hf     # out_dir/export-hf/, from the checkpoint

Which class reads it depends on the shape (model.py's blocks match these to ~1e-6):

    QK-norm, no NoPE layers      Qwen3ForCausalLM      (per-head q/k RMSNorm before RoPE)
    no QK-norm                   SmolLM3ForCausalLM    (its no_rope_layers say which layers
                                                        rotate, by stacklm's own rule)
    QK-norm and NoPE layers      StackLMForCausalLM    (no stock class has both: a Qwen3
                                                        subclass in modeling_stacklm.py,
                                                        loaded with trust_remote_code=True)

The last names its own model_type, `stacklm`, so a tool that ignores remote code refuses
the folder instead of running it as plain Qwen3, which would rotate the NoPE layers (its
logits are off by ~0.16). The folder holds config.json (with rope_theta and
rope_parameters, which transformers 4.57 and 5 read respectively), generation_config.json,
model.safetensors (the tied embedding written once), and a tokenizer that 4.57 and 5 load.

Imports from stacklm: config (the model's shape) and data (the EOS token).
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from config import StackConfig
from data import EOS_TOKEN

MODELING_FILE = Path(__file__).resolve().parent / "hf_modeling_stacklm.py"


def architecture(cfg: StackConfig) -> str:
    """The transformers class that computes what this shape computes."""
    if not cfg.qk_norm:
        return "SmolLM3ForCausalLM"
    return "StackLMForCausalLM" if cfg.nope_every else "Qwen3ForCausalLM"


def needs_remote_code(cfg: StackConfig) -> bool:
    return architecture(cfg) == "StackLMForCausalLM"


def hf_config(cfg: StackConfig, eos_id: int, revision: str) -> dict:
    """config.json for `architecture(cfg)`; the EOS id is also BOS and padding, as in
    training, where EOS opens every document."""
    arch = architecture(cfg)
    config = {
        "architectures": [arch], "model_type": {"Qwen3ForCausalLM": "qwen3",
                                                 "SmolLM3ForCausalLM": "smollm3",
                                                 "StackLMForCausalLM": "stacklm"}[arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "use_sliding_window": False,
        # 4.57 reads rope_theta, 5.x rope_parameters: both, or one of them trains on 10,000
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
        "torch_dtype": "float32", "stacklm_revision": revision,
    }
    if arch != "Qwen3ForCausalLM":  # 1 = this layer rotates, stacklm's uses_rope rule
        config["no_rope_layers"] = [int(not cfg.nope_every or (i + 1) % cfg.nope_every != 0)
                                    for i in range(cfg.n_layers)]
    if needs_remote_code(cfg):
        config["auto_map"] = {"AutoConfig": "modeling_stacklm.StackLMConfig",
                              "AutoModelForCausalLM": "modeling_stacklm.StackLMForCausalLM"}
    return config


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack's parameter names -> transformers'. The head is the embedding (tied): written
    once, as model.embed_tokens.weight, which transformers ties back."""
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attn": "self_attn", "mlp": "mlp"}
    out = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if key == "embed.weight":
            name = "model.embed_tokens.weight"
        elif key == "norm.weight":
            name = "model.norm.weight"
        else:  # blocks.N.<module>.<...>
            name = ".".join(["model", "layers", parts[1], names[parts[2]], *parts[3:]])
        out[name] = tensor.detach().to(torch.float32).contiguous().clone()
    return out


def write(folder, state: dict, cfg: StackConfig, tokenizer_file, eos_id: int, revision: str,
          config: dict | None = None) -> Path:
    """The whole folder, written aside and renamed when complete. `config` replaces the
    derived config.json (the tests' negative controls use it)."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = config or hf_config(cfg, eos_id, revision)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
         "do_sample": True, "temperature": 0.8, "top_k": 50}, indent=1))
    # "format": "pt" is what 4.57 asks of a safetensors file before it loads it
    save_file(hf_state_dict(state), tmp / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(tokenizer_file, tmp / "tokenizer.json")
    # PreTrainedTokenizerFast loads in 4.57 and 5.x alike (5's TokenizersBackend does not)
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN,
         "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
         "model_max_length": cfg.max_seq_len}, indent=1))
    (tmp / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, indent=1))
    if config.get("auto_map"):
        shutil.copy(MODELING_FILE, tmp / "modeling_stacklm.py")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
