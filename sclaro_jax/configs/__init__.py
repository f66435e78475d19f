"""The recipes, inside the package so an installed sclaro-jax finds them: each module defines
`get_config(variant=None) -> ml_collections.ConfigDict`, `VARIANTS` (variant -> description,
"" for none) and `RANGES` (dotted key -> `sclaro_jax.config.Range`: every numeric and path
key's range, checked by the task before a run starts). Load one by name,
`sclaro_jax.config.load_config("scenarioclip:demo")`, or from a checkout by its file,
`configs/scenarioclip.py:demo` (the same recipe). Recipes import only public config types
(`config.Range`, `recipes.TrainConfig`, `recipes.DetectorConfig`), which import no JAX: a
command line is checked, and refused, without loading JAX.
"""
