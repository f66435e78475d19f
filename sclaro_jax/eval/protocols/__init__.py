"""The ScenarioCLIP protocols (`python -m sclaro_jax.eval.suite`; docs/design.md, section 3):
the evaluators registered by name (`registry`: `zero_shot`, `probe`, `scene_graph`, `localise`),
the split's embeddings they share (`embedding`), all of them on one split (`scenario`), their
metrics, tables (`report`), figures and parameter / FLOPs table (`cost`). Imports
`sclaro_jax.eval.encoders`, never the retrieval family."""
