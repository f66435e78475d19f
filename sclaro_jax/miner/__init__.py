"""MINER: training-free multi-crop retrieval for frozen dual encoders (DESIGN.md section 4).

`crops` makes the region boxes; `kernels` scores in-memory matrices: fusion, CSLS and its
alternatives, recall and hubness.
"""

from .crops import crop_boxes, crop_images
from .kernels import (csls, csls_shortlist, dual_softmax, fused_scores, hubness, qbnorm, ranks,
                      recall_at_k, sinkhorn, topk_mean)

__all__ = ["crop_boxes", "crop_images", "csls", "csls_shortlist", "dual_softmax", "fused_scores",
           "hubness", "qbnorm", "ranks", "recall_at_k", "sinkhorn", "topk_mean"]
