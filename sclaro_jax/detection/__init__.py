"""Faster R-CNN + FPN detection over the project's CLIP encoders: ops, model, data, train, evaluate."""
