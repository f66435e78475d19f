"""The SCLARO annotation pipeline (PyTorch side): images -> VLM JSON -> boxes -> masks ->
focused regions -> curated labels -> ArrayRecord shards. May import `sclaro_jax`, never the
reverse."""
