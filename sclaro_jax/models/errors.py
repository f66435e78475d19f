"""The error of a checkpoint a model cannot load, in a module of its own that needs no JAX: the
torch-file reader (`torch_files`) raises it, and a process that only reads a torch file (a
refusal of a damaged one, say) loads neither JAX nor flax for it."""


class CheckpointError(ValueError):
    """A folder that does not hold a Hugging Face checkpoint this model can load."""
