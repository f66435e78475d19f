"""MINER / ROCS text-to-image retrieval (`python -m sclaro_jax.eval.rocs`): the splits it reads
(`data`), the gallery's global and crop embeddings, cached (`gallery`), the scorings and their
tables (`scoring`) and the planted-colours benchmark with its encoder (`synthetic`). Imports
`sclaro_jax.eval.encoders`, never the protocols."""
