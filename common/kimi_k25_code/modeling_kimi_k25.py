"""Model class of the Kimi-K2.5-style miniature target (written by this project).

The text model is transformers' own `DeepseekV3ForCausalLM` under `language_model`, next to
a (toy) vision tower and multimodal projector, so the checkpoint's key names are those of the
real Kimi-K2.5: `language_model.model.*`, `language_model.lm_head.weight`, `vision_tower.*`,
`mm_projector.*`. The vision part only exists to be present in the checkpoint; the pipeline
never instantiates it.
"""

import torch
from torch import nn
from transformers import DeepseekV3ForCausalLM, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class MoonViTStub(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(3 * config.patch_size**2, config.hidden_size)
        self.blocks = nn.ModuleList(
            nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.num_hidden_layers)
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size)


class PatchMergerProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        merged = config.hidden_size * config.merge_kernel_size[0] * config.merge_kernel_size[1]
        self.pre_norm = nn.LayerNorm(config.hidden_size)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.mm_hidden_size))


class KimiK25ForConditionalGeneration(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = "language_model"

    def __init__(self, config: KimiK25Config) -> None:
        super().__init__(config)
        self.vision_tower = MoonViTStub(config.vision_config)
        self.mm_projector = PatchMergerProjector(config.vision_config)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)

    def forward(self, input_ids: torch.Tensor, **kwargs):
        """Text-only forward pass (images are out of scope for the miniature)."""
        return self.language_model(input_ids=input_ids, **kwargs)
