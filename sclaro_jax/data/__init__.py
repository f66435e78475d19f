"""Input side of training: the offline CLIP tokenizer (`tokenizer`)."""
