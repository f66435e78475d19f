"""The detector's run from a config alone (configs/detection.py), as `launch/train.py` and
`python -m sclaro_jax.eval.detect` start it: the dataset of `config.data.dir`, the encoders of
`config.backbone` (`backbones.from_config`), the Detector, then `train.train` (through
`sclaro_jax.run.run_steps`) in the workdir."""

from __future__ import annotations

import dataclasses

from sclaro_jax.detection import backbones, data, train
from sclaro_jax.detection.model import Detector


@dataclasses.dataclass
class Prepared:
    model: Detector
    examples: list  # the training examples at the detection size
    classes: list[str]
    name: str  # the backbone, for the results table
    shared: bool  # one encoder feeds both the RPN and the RoI heads
    dtype: object


def prepare(config, *, verify_data: bool = False) -> Prepared:
    """The detector and its training examples for `config` (ValueError: a split without boxes;
    with `verify_data`, every shard's sha256 is checked against the manifest first; learning
    rates that are not positive are refused before anything is read)."""
    train.check_rates(config)
    if verify_data:
        from sclaro_jax.data.dataset import open_dataset
        open_dataset(config.data.dir, verify=True).check_files(config.train_split)
    dtype = train.compute_dtype(config.dtype)
    rpn, roi, patch, name = backbones.from_config(config, dtype)
    examples, classes = data.load_examples(config.data.dir, config.train_split)
    if not examples:
        raise ValueError(f"{config.data.dir}: the {config.train_split!r} split holds no boxes")
    cfg = train.detector_config(config, len(classes))
    examples = [data.resize_for_detection(ex, cfg.image_size, config.input_resize)
                for ex in examples]
    model = Detector(cfg, rpn, patch, roi, dtype=dtype, seed=config.seed)
    return Prepared(model, examples, classes, name, roi is None, dtype)


def total_steps(config, examples: int) -> int:
    return train.total_steps(config, examples)


def fit(config, workdir: str, prepared: Prepared, *, progress: bool = True,
        allow_config_change: bool = False, stop_at: int | None = None):
    """`train.train` of the prepared detector in `workdir`: (graphdef, state, info)."""
    return train.train(config, workdir, prepared.model, prepared.examples,
                       len(prepared.classes), progress=progress, stop_at=stop_at,
                       allow_config_change=allow_config_change)


def run(config, workdir: str, *, progress: bool = True, allow_config_change: bool = False,
        verify_data: bool = False, stop_at: int | None = None):
    """Train (or resume) the detector of `config` in `workdir`: (graphdef, state, info)."""
    from sclaro_jax.run.folder import check_workdir

    check_workdir(workdir)
    prepared = prepare(config, verify_data=verify_data)
    return fit(config, workdir, prepared, progress=progress,
               allow_config_change=allow_config_change, stop_at=stop_at)
