"""Evaluation, in two families that never import each other: the ScenarioCLIP protocols
(`protocols`, run by `python -m sclaro_jax.eval.suite` and, by name, during training) and MINER /
ROCS retrieval (`retrieval`, run by `python -m sclaro_jax.eval.rocs`). What both use sits at
this level (`encoders`: model loading and the encoding stack), beside the command lines (`suite`,
`rocs`, and `detect` for the detector); neither family imports a command line."""
