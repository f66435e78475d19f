"""Train ScenarioCLIP or a baseline:

    python launch/train.py --config configs/scenarioclip.py[:ARG] --workdir DIR [--config.x.y=V]

Rerunning the same command resumes from the newest checkpoint in DIR.
"""

import argparse
import sys

NOT_BUILT = """\
ScenarioCLIP training is not built yet.

What exists today: the Flax NNX CLIP towers with Hugging Face weight import/export
(sclaro_jax.models.clip) and the offline CLIP tokenizer (sclaro_jax.data.tokenizer); see
README.md. The trainer, the demo dataset and the configs' training recipe arrive with the
records/input-pipeline and ScenarioCLIP-training issues."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="config file, optionally with :ARG (e.g. configs/scenarioclip.py:demo)")
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl, TensorBoard")
    parser.parse_known_args(argv)  # --config.x.y=V overrides are accepted and not yet used
    print(NOT_BUILT, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
