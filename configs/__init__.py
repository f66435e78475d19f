"""ml_collections configs: `get_config(arg)` per file; `file.py:arg` on the command line."""
