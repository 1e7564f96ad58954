"""modeling_stacklm.py of a transformers export (export.py copies this file there):
Stack-100M's shape, QK-norm and NoPE layers together, as a Qwen3 subclass.

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

Qwen3 has the per-head QK-norm before RoPE that stacklm has. The one difference is that
every `no_rope_layers[i] == 0` layer skips the rotation: it sees cos = 1 and sin = 0, the
identity rotation, and is otherwise Qwen3's attention, weights and names unchanged.

Imports from stacklm: nothing (transformers loads this file on its own, from the export).
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention


class StackLMConfig(Qwen3Config):
    """Qwen3's config and which layers rotate (1) or not (0)."""
    model_type = "stacklm"

    def __init__(self, no_rope_layers=None, **kwargs):
        super().__init__(**kwargs)
        self.no_rope_layers = no_rope_layers or [1] * self.num_hidden_layers


class NoPEAttention(Qwen3Attention):
    """Qwen3's attention with the identity rotation (NoPE, arXiv 2305.19466)."""

    def forward(self, hidden_states, position_embeddings, *args, **kwargs):
        cos, sin = position_embeddings
        identity = (torch.ones_like(cos), torch.zeros_like(sin))
        return super().forward(hidden_states, identity, *args, **kwargs)


class StackLMForCausalLM(Qwen3ForCausalLM):
    config_class = StackLMConfig

    def __init__(self, config: StackLMConfig):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            if not config.no_rope_layers[i]:
                layer.self_attn = NoPEAttention(config, i)
