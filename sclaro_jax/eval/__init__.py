"""Evaluation: ScenarioCLIP protocols (`python -m sclaro_jax.eval.suite`) and MINER / ROCS
retrieval (`python -m sclaro_jax.eval.rocs`)."""
