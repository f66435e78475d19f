"""Input side of training: the batch contract (`batch`), the Grain pipeline (`pipeline`,
with `augment`), the dataset folder and its records (`dataset`, `schema`) and the offline CLIP
tokenizer (`tokenizer`)."""
