"""One level of a ScenarioCLIP / PyramidCLIP model (sclaro-jax) for transformers.

This file is copied into each export of `python -m sclaro_jax.train.export`; transformers runs it
with `trust_remote_code=True`:

    model = transformers.AutoModel.from_pretrained(OUT, trust_remote_code=True)
    processor = transformers.CLIPProcessor.from_pretrained(OUT)
    image_emb = model.get_image_features(**processor(images=image, return_tensors="pt"))

`ScenarioCLIPModel` is transformers' `CLIPModel` whose `visual_projection` / `text_projection` are
the level's heads, `nn.Sequential(nn.Linear(hidden, D), nn.LayerNorm(D, eps=1e-5))`, in place
of CLIP's bias-free projection matrices, so `get_image_features` / `get_text_features` give the
level's embeddings (LayerNormed, not L2-normalised) and `forward`'s `logits_per_image` is
`logit_scale.exp() * cos(image, text)`. The weights are in model.safetensors under these names
(`visual_projection.0.weight`, ...). The config's model_type is "scenarioclip" (a `CLIPConfig`
otherwise), so transformers does not silently load the folder into a plain `CLIPModel` with
fresh projections when `trust_remote_code` is not given.
"""

from torch import nn
from transformers import CLIPConfig, CLIPModel
from transformers import initialization as init


class ScenarioCLIPConfig(CLIPConfig):
    """`CLIPConfig` of a ScenarioCLIP level: `projection_dim` is the heads' output size D."""

    model_type = "scenarioclip"


def _head(width: int, dim: int) -> nn.Sequential:
    """ScenarioCLIP's head: Linear(width, D) then LayerNorm(D) (eps 1e-5, as sclaro_jax's)."""
    return nn.Sequential(nn.Linear(width, dim), nn.LayerNorm(dim, eps=1e-5))


class ScenarioCLIPModel(CLIPModel):
    """`CLIPModel` with ScenarioCLIP's Linear+LayerNorm heads as its projections."""

    config_class = ScenarioCLIPConfig
    config: ScenarioCLIPConfig

    def __init__(self, config: ScenarioCLIPConfig):
        super().__init__(config)
        self.visual_projection = _head(self.vision_embed_dim, self.projection_dim)
        self.text_projection = _head(self.text_embed_dim, self.projection_dim)
        self.post_init()

    def _init_weights(self, module):
        """CLIP's initialisation, but the projections are heads, not bare matrices (CLIP's own
        rule would look for their `.weight`): Linear normal(0, width ** -0.5), zero bias;
        LayerNorm ones and zeros. Weights read from a checkpoint are not touched."""
        if not isinstance(module, ScenarioCLIPModel):
            super()._init_weights(module)
            return
        factor = self.config.initializer_factor
        for head, width in ((module.visual_projection, module.vision_embed_dim),
                            (module.text_projection, module.text_embed_dim)):
            init.normal_(head[0].weight, std=width ** -0.5 * factor)
            init.zeros_(head[0].bias)
            init.ones_(head[1].weight)
            init.zeros_(head[1].bias)
        init.constant_(module.logit_scale, self.config.logit_scale_init_value)


__all__ = ["ScenarioCLIPConfig", "ScenarioCLIPModel"]
