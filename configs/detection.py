"""Faster R-CNN detection recipe (`python -m sclaro_jax.eval.detect --config configs/detection.py`).

The appendix protocol: 10 epochs of AdamW, encoders at 1e-5 and the pyramids / FPN / heads at
1e-4, 5% linear warm-up then cosine; instance-aware sampling and copy-paste for classes with
fewer than 50 training instances; score threshold 1e-4, NMS 0.5, 300 detections per image.
Every key and its default: `sclaro_jax.detection.train.default_config`. Variant `demo`: CPU
minutes on the bundled demo dataset.
"""

from sclaro_jax.detection.train import default_config


def get_config(arg: str | None = None):
    return default_config(arg)
