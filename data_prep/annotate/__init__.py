"""The annotation wing: images -> SCLARO records through the VLM, GroundingDINO and SAM stages
(`python -m data_prep annotate`).

`pipeline` runs a job (its names are re-exported here, where `data_prep.annotate` always had
them), `stages` holds the functions of one block, `ray_engine` the Ray Data engine, `keys` the
content keys of the caches and `cli` the sub-command. Shared pieces (sources, models, shards,
durable logs) live at the top of `data_prep`; this wing imports no other wing.
"""

from data_prep.annotate.pipeline import (MODEL_FLAGS, AnnotateConfig, Annotator, HashMemo,
                                         JsonLog, Models, Run, StageInputs, Summary, annotate,
                                         check_model_flags, check_run_key, config_key,
                                         format_summary, load_detector, load_models,
                                         load_segmenter, load_vlm, pick_device, replies_for,
                                         source_items)

__all__ = ["MODEL_FLAGS", "AnnotateConfig", "Annotator", "HashMemo", "JsonLog", "Models", "Run",
           "StageInputs", "Summary", "annotate", "check_model_flags", "check_run_key",
           "config_key", "format_summary", "load_detector", "load_models", "load_segmenter",
           "load_vlm", "pick_device", "replies_for", "source_items"]
