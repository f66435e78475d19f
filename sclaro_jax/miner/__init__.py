"""MINER: training-free multi-crop retrieval for frozen dual encoders (docs/design.md, section 4).

`crops` makes the region boxes; `kernels` holds MINER's two equations as pure functions (`fuse`,
`csls_combine`) and scores in-memory matrices with them: fusion, CSLS and its alternatives,
recall and hubness; `stream` and `sharded` search a gallery too large for one `[Q, G]` matrix
with the same two functions.
"""

from .crops import crop_boxes, crop_images
from .kernels import (csls, csls_combine, csls_shortlist, dual_softmax, fuse, fused_scores,
                      hubness, hubness_from_topk, qbnorm, ranks, recall_at_k, recall_from_ranks,
                      sinkhorn, topk_mean)

__all__ = ["crop_boxes", "crop_images", "csls", "csls_combine", "csls_shortlist", "dual_softmax",
           "fuse", "fused_scores", "hubness", "hubness_from_topk", "qbnorm", "ranks",
           "recall_at_k", "recall_from_ranks", "sinkhorn", "topk_mean"]
