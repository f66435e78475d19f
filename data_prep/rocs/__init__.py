"""The ROCS wing: a ROCS-style retrieval split (MINER section 3) from any image set
(`python -m data_prep rocs`).

`pipeline` builds the split (its names are re-exported here, where `data_prep.rocs` always had
them), `selection` holds the pure selection steps, `caption` the class-aware captions and the
output, `cli` the sub-command. Shared pieces (GroundingDINO, SAM, VLM replies) live at the top
of `data_prep`; this wing imports no other wing.
"""

from data_prep.rocs.pipeline import (CLASS_LISTS, COCO80, IMAGE_SUFFIXES, AnnotatedImage,
                                     StageCache, build_rocs, class_list, detect_instances,
                                     mask_step, prompt_groups, stats_figure)

__all__ = ["CLASS_LISTS", "COCO80", "IMAGE_SUFFIXES", "AnnotatedImage", "StageCache",
           "build_rocs", "class_list", "detect_instances", "mask_step", "prompt_groups",
           "stats_figure"]
