"""Every numeric and path key of every recipe has a declared range (`sclaro_jax.config.Range`:
a recipe's RANGES, `ranged` dataclass fields), checked in one place (`config.validate`) by each
task's `check` before anything runs: a value outside it is one `error:` line naming the key,
exit 2. Cheap: no training (one launcher process for the command-line cases)."""

import dataclasses
import importlib
import math

import ml_collections
import pytest
from conftest import launch_all

from sclaro_jax.config import (Range, RangeError, check_fields, field_ranges, flatten,
                               load_config, ranged, recipes, unranged, validate)



def _specs():
    """(recipe:variant, its module) of every recipe and variant of the package."""
    for name in recipes():
        module = importlib.import_module(f"sclaro_jax.configs.{name}")
        for variant in getattr(module, "VARIANTS", {"": ""}):
            yield (f"{name}:{variant}" if variant else name), module


@pytest.mark.parametrize("spec,module", list(_specs()), ids=lambda x: x if isinstance(x, str)
                         else "")
def test_every_numeric_key_of_every_recipe_has_a_range(spec, module):
    config = load_config(spec)
    assert unranged(config, module.RANGES) == [], spec
    validate(config, module.RANGES)  # the defaults are inside their ranges
    declared = set(module.RANGES)
    assert any(module.RANGES[k].path for k in declared if k.endswith("data.dir")), spec


def test_the_psg_variant_is_the_paper_recipe_evaluated_on_test():
    paper, psg = load_config("scenarioclip"), load_config("scenarioclip:psg")
    assert psg.data.dir == "" and psg.evals.zero_shot.split == "test"  # the import has no val
    assert "import --source psg" in psg.data.prepare
    changed = {k for k, v in flatten(psg).items() if flatten(paper).get(k) != v}
    assert changed == {"data.prepare", "evals.zero_shot.split"}


def test_a_planted_key_or_field_without_a_range_is_caught():
    from sclaro_jax.configs import scenarioclip
    from sclaro_jax.train.core import TrainConfig

    config = load_config("scenarioclip:demo")
    config.data.new_size = 7  # a recipe key added without a range
    config.train.new_rate = 0.5
    config.model.switch = True  # a switch is not a number
    config.detector = ml_collections.ConfigDict({"sizes": (1, 2), "names": ("a",)})
    assert sorted(unranged(config, scenarioclip.RANGES)) == ["data.new_size", "detector.sizes",
                                                             "train.new_rate"]

    # a TrainConfig field added without `ranged`: the recipe's train keys come from its fields
    planted = dataclasses.make_dataclass(
        "Planted", [("new_steps", int, dataclasses.field(default=3))], bases=(TrainConfig,),
        frozen=True)
    ranges = {k: v for k, v in scenarioclip.RANGES.items() if not k.startswith("train.")}
    ranges.update({"train.epochs": Range(ge=0), "train.steps": Range(ge=0),
                   **field_ranges(planted, "train.")})
    config = load_config("scenarioclip")
    config.train.new_steps = 3
    assert unranged(config, ranges) == ["train.new_steps"]


def test_ranges_say_what_is_wrong(tmp_path):
    assert Range(ge=1).problem(0) == "must be >= 1"
    assert Range(gt=0).problem(-1e-3) == "must be > 0"
    assert Range(ge=0, le=1).problem(1.5) == "must be >= 0 and <= 1"
    assert Range(gt=0).problem(math.nan) == "must be > 0"  # NaN is in no range
    assert Range(ge=1).problem((4, 0, 8)) == "each must be >= 1"
    assert Range(ge=1).problem("8") == "must be >= 1, got str"
    assert Range(ge=0, note="0: off").problem(-1) == "must be >= 0 (0: off)"
    assert Range(ge=1).problem(1) is None and Range(ge=0, lt=1).problem(0.999) is None
    assert Range(path=True, exists=True).problem("") is None  # empty: not given
    assert Range(path=True, exists=True).problem(str(tmp_path)) is None
    assert Range(path=True, exists=True).problem(str(tmp_path / "no")) == \
        "no such file or folder"
    assert Range(path=True).problem(str(tmp_path / "no")) is None  # made when needed

    config = ml_collections.ConfigDict({"a": 0, "b": {"c": -2.0, "d": 5}, "evals": {
        "x": {"every": -1}, "y": {"every": 10}}})
    ranges = {"a": Range(ge=1), "b.c": Range(gt=0), "b.d": Range(ge=1),
              "evals.*.every": Range(ge=0)}
    with pytest.raises(RangeError) as e:
        validate(config, ranges)
    assert str(e.value) == ("config.a = 0: must be >= 1; config.b.c = -2.0: must be > 0; "
                            "config.evals.x.every = -1: must be >= 0")
    assert isinstance(e.value, ValueError)  # the launcher's one-line user error


def test_a_recipe_built_in_code_is_held_to_the_same_ranges():
    from sclaro_jax.detection.model import DetectorConfig
    from sclaro_jax.train.core import TrainConfig

    with pytest.raises(RangeError, match=r"^config.train.lr = -1: must be > 0$"):
        TrainConfig(total_steps=10, lr=-1)
    with pytest.raises(RangeError, match=r"config.train.ema_decay = 1.5: must be >= 0 and <= 1"):
        TrainConfig(total_steps=10, ema_decay=1.5)
    with pytest.raises(RangeError, match=r"^config.detector.num_classes = 0: must be >= 1$"):
        DetectorConfig(num_classes=0)
    with pytest.raises(RangeError, match=r"config.detector.strides = \(4, 0, 16, 32\): each"):
        DetectorConfig(num_classes=3, strides=(4, 0, 16, 32))

    @dataclasses.dataclass(frozen=True)
    class Small:
        n: int = ranged(1, ge=1)
        free: float = 0.5

        def __post_init__(self):
            check_fields(self, "small.")

    assert Small(n=2).n == 2
    with pytest.raises(RangeError, match=r"config.small.n = 0: must be >= 1"):
        Small(n=0)


# (recipe, override, the key and range the one error line names)
CASES = [
    ("scenarioclip:demo", "--config.data.batch_size=0", "config.data.batch_size = 0: must be >= 1"),
    ("scenarioclip:demo", "--config.data.batch_size=-1",
     "config.data.batch_size = -1: must be >= 1"),
    ("scenarioclip:demo", "--config.train.lr=-0.001", "config.train.lr = -0.001: must be > 0"),
    ("scenarioclip:demo", "--config.train.lr=0", "config.train.lr = 0.0: must be > 0"),
    ("scenarioclip:demo", "--config.train.steps=-5",
     "config.train.steps = -5: must be >= 0 (0: train.epochs give the run's length)"),
    ("scenarioclip:demo", "--config.train.steps=0",
     "config.train.steps = 0 and config.train.epochs = 0: one of them must be >= 1"),
    ("pyramidclip:demo", "--config.train.ema_decay=1.5",
     "config.train.ema_decay = 1.5: must be >= 0 and <= 1"),
    ("scenarioclip_nokd", "--config.checkpoint_every=0",
     "config.checkpoint_every = 0: must be >= 1"),
    ("scenarioclip:demo", "--config.data.dir=/nonexistent/sclaro",
     "config.data.dir = '/nonexistent/sclaro': no such file or folder (a dataset folder"),
    ("detection:demo", "--config.epochs=0", "config.epochs = 0: must be > 0"),
    ("detection:demo", "--config.epochs=-1", "config.epochs = -1: must be > 0"),
    ("detection:demo", "--config.batch_size=0", "config.batch_size = 0: must be >= 1"),
    ("detection:demo", "--config.batch_size=-1", "config.batch_size = -1: must be >= 1"),
    ("detection:demo", "--config.head_lr=-0.0001", "config.head_lr = -0.0001: must be > 0"),
    ("detection", "--config.detector.box_positive_fraction=1.5",
     "config.detector.box_positive_fraction = 1.5: must be >= 0 and <= 1"),
    ("detection:demo", "--config.keep_checkpoints=0", "config.keep_checkpoints = 0: must be >= 1"),
    # not a range: a recipe whose data must be imported names the flag and the import command
    ("scenarioclip:psg", "--config.train.steps=5", "config.data.dir is empty: pass "
     "--config.data.dir=DIR, the dataset written by `python -m data_prep import --source psg "),
]

def test_values_outside_their_ranges_are_one_error_line_before_anything_runs(tmp_path):
    workdirs = [tmp_path / f"w{i}" for i in range(len(CASES))]
    argvs = [["--config", spec, "--workdir", str(w), flag]
             for (spec, flag, _), w in zip(CASES, workdirs)]
    # one launcher process runs every case, in turn (conftest.launch_all)
    for (spec, flag, expected), workdir, got in zip(CASES, workdirs, launch_all(argvs)):
        lines = [x for x in got.stderr.splitlines() if x.startswith("error:")]
        assert got.returncode == 2 and len(lines) == 1, (spec, flag, got)
        assert lines[0].startswith(f"error: {expected}"), (spec, flag, lines[0])
        assert "Traceback" not in got.stderr, got.stderr
        assert not workdir.exists(), (spec, flag)  # refused before anything was written
