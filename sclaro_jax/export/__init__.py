"""What leaves the project for other tools: a model level as a Hugging Face folder with its model
code, or a plain CLIP as an open_clip / Hugging Face folder (`hf`; its command line is `command`,
run as `python -m sclaro_jax.train.export`), and a SCLARO split as a CLIP_benchmark webdataset
(`wds`, `python -m sclaro_jax.export.wds`). Reads checkpoints, models and datasets; imports
nothing of `train`, `eval` or `detection`."""
