"""The command lines above both sides (`sclaro_jax`, `data_prep`): `python launch/train.py` in a
checkout, `python -m launch.train` or `sclaro-train` where sclaro-jax is installed."""
