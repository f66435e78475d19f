"""One level of a ScenarioCLIP / PyramidCLIP model (sclaro-jax) for transformers.

This file is copied into each export of `python -m sclaro_jax.train.export`; transformers runs it
with `trust_remote_code=True`:

    model = transformers.AutoModel.from_pretrained(OUT, trust_remote_code=True)
    processor = transformers.CLIPProcessor.from_pretrained(OUT, trust_remote_code=True)
    inputs = processor(images=image, return_tensors="pt")
    image_emb = model.get_image_features(**inputs).pooler_output  # [1, D]

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
        """CLIP's initialisation, but for the heads (CLIP's rule for the projections looks for
        a `.weight` they do not have): Linear normal(0, width ** -0.5), zero bias; LayerNorm
        ones and zeros; `logit_scale` the config's init value. Weights read from a checkpoint
        are not touched."""
        factor = self.config.initializer_factor
        for head, width in self._heads():
            if module is head[0]:
                init.normal_(module.weight, std=width ** -0.5 * factor)
                init.zeros_(module.bias)
                return
            if module is head[1]:
                init.ones_(module.weight)
                init.zeros_(module.bias)
                return
        super()._init_weights(module)
        if isinstance(module, ScenarioCLIPModel):
            init.constant_(module.logit_scale, self.config.logit_scale_init_value)

    def _heads(self):
        """(head, input width) pairs; none while `CLIPModel.__init__` runs (it initialises
        the model before the heads replace CLIP's projections)."""
        if not isinstance(getattr(self, "visual_projection", None), nn.Sequential):
            return []
        return [(self.visual_projection, self.vision_embed_dim),
                (self.text_projection, self.text_embed_dim)]


__all__ = ["ScenarioCLIPConfig", "ScenarioCLIPModel"]
