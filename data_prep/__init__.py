"""The SCLARO annotation pipeline (PyTorch side): images -> VLM JSON -> boxes -> masks ->
focused regions -> curated labels -> ArrayRecord shards. May import `sclaro_jax`, never the
reverse.

Three wings, which never import each other: `annotate` (images -> records), `curate` (labels ->
shared vocabularies) and `rocs` (ROCS-style retrieval splits). What they share sits at this
level: records and shards (`shards`, `views`, `reshard`), the models (`vlm`, `vlm_reply`,
`loose_json`, `detect`, `segment`, `focus`), image sources (`sources`, `source_items`), durable
files (`durable_logs`), the demo (`demo`), test helpers (`testing`) and the command-line
plumbing (`cli`)."""
