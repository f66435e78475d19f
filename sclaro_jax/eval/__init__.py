"""Evaluation: MINER / ROCS retrieval (`python -m sclaro_jax.eval.rocs`)."""
