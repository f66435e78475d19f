"""The one short table of a `bench/gpu_session.sh` run, from the JSON its stages wrote in OUT:
each issue target against its bar, the profile's largest kinds of work, the variants against
the default, the annotation stages and pipeline, the MINER index's search, and how each stage
ended.

    python bench/gpu_session_table.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (what, bar as text, met(value)) of the GPU targets; a CPU run prints them for the form
BARS = {
    "examples_per_sec": ("real-data examples/s, trainer (paper recipe, demo counts)", ">= 1,400",
                         lambda v: v >= 1400),
    "useful_mfu": ("useful MFU, same run", ">= 40%", lambda v: v >= 0.40),
    "compile_s": ("compile, every executable, cold cache", "<= 90 s", lambda v: v <= 90),
    "first_loss_s": ("first loss after start, warm rerun that resumes", "<= 20 s",
                     lambda v: v <= 20),
    "csls_ratio": ("CSLS resident: ours / authors' torch", "<= 0.5x", lambda v: v <= 0.5),
    "csls_bandwidth": ("CSLS resident: bytes/s / device copy's", ">= 50%", lambda v: v >= 0.5),
}


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def targets(out: Path) -> dict:
    found = {}
    run = load(out / "run.json")
    if run:
        found["examples_per_sec"] = run["examples_per_sec"]
        found["useful_mfu"] = run["useful_mfu"]
        cold, warm = run["starts"].get("cold", {}), run["starts"].get("warm", {})
        if cold.get("compile_s") is not None:
            found["compile_s"] = cold["compile_s"]
        if warm.get("first_loss_after_start_s") is not None:
            found["first_loss_s"] = warm["first_loss_after_start_s"]
    miner = load(out / "miner.json") or []
    largest = max((r["images"] for r in miner), default=None)
    for row in (r for r in miner if r["images"] == largest):
        found["csls_bandwidth"] = row["ours_gb_s"] / row["copy_gb_s"]
        if row["theirs"] == "torch":
            found["csls_ratio"] = row["ours_ms"] / row["theirs_ms"]
    return found


def shown(key: str, value: float) -> str:
    if key in ("useful_mfu", "csls_bandwidth"):
        return f"{value:.1%}"
    if key == "csls_ratio":
        return f"{value:.2f}x"
    return f"{value:,.0f}" if key == "examples_per_sec" else f"{value:.1f} s"


def annotate_lines(report) -> list[str]:
    """The annotate stage (bench/bench_annotate_gpu.py): images/s of each stage at the
    pipeline's batch (SAM: one image a call) and the largest, the VLM's tokens/s, the pipeline,
    each switch's speed-up at the pipeline's batch."""
    if not report:
        return []
    block = report["pipeline_batch"]

    def rows(stage, **match):
        return [r for r in report.get(stage, []) if all(r.get(k) == v for k, v in match.items())]

    def two(stage, first, key="images_per_s", **match):
        found = {r["batch"]: r for r in rows(stage, **match)}
        shown = [f"{found[b][key]:,.1f} @{b}" if found.get(b, {}).get(key) else f"- @{b}"
                 for b in dict.fromkeys((first, max(found, default=first)))]
        return " / ".join(shown)

    lines = [f"annotate ({report['form']}, {report['device_name']}), images/s at the pipeline's "
             f"batch / the largest: VLM {two('vlm', block, static_cache=False)} "
             f"({two('vlm', block, 'tokens_per_s', static_cache=False)} tokens/s); "
             f"GroundingDINO {two('detect', block, switch='default')}; SAM per image "
             f"{two('segment', 1, what='segmenter', switch='default')}, its image encoder "
             f"{two('segment', 1, what='image_encoder')}"]
    pipe = report.get("pipeline")
    if pipe:
        bound = pipe.get("overlapped_bound_images_per_s")
        lines.append(f"annotate pipeline (local engine, {pipe['images']} images, blocks of "
                     f"{pipe['batch_size']}, {pipe['new_tokens']} VLM tokens each): "
                     f"{pipe['images_per_s']:,.2f} images/s, "
                     f"{pipe['device_hours_per_100k']:,.1f} device-hours per 100,000 images; "
                     f"stages overlapped (--engine ray) at most "
                     + (f"{bound:,.2f} images/s" if bound else "-"))
    speedups = []
    for stage, key, default, match in (
            ("detect", "switch", "default", {"batch": block}),
            ("segment", "switch", "default", {"batch": 1, "what": "segmenter"}),
            ("vlm", "static_cache", False, {"batch": block})):
        base = next((r.get("images_per_s") for r in rows(stage, **match, **{key: default})),
                    None)
        for r in rows(stage, **match):
            if r[key] != default:
                name = "vlm_static_cache" if stage == "vlm" else f"{r[key]} ({stage})"
                speedups.append(f"{name} {r['images_per_s'] / base:.2f}x"
                                if base and r.get("images_per_s") else f"{name} error")
    if speedups:
        lines.append("annotate switches (speed-up over default at the pipeline's batch): "
                     + "; ".join(speedups))
    return lines


def render(out: Path) -> str:
    lines = []
    profile = load(out / "profile" / "profile.json")
    if profile:
        run = profile["run"]
        lines.append(f"device {run.get('device')}, jax {run.get('jax')}, preset "
                     f"{run.get('preset')}, batch {run.get('batch')}, {run.get('dtype')}")
    found = targets(out)
    lines += ["", "| target | measured | bar | met |", "|---|---|---|---|"]
    for key, (what, bar, met) in BARS.items():
        if key in found:
            lines.append(f"| {what} | {shown(key, found[key])} | {bar} | "
                         f"{'yes' if met(found[key]) else 'no'} |")
        else:
            lines.append(f"| {what} | - | {bar} | not measured |")
    if profile:
        rows = sorted(profile["rows"], key=lambda r: -r["share"])[:5]
        lines.append("")
        lines.append(f"profile, step {profile['summary']['step_ms']:.1f} ms: " + "; ".join(
            f"{r['kind']} {r['share']:.0%}" + (f" ({r['of_ceiling']:.0%} of its ceiling)"
                                              if r.get("of_ceiling") else "")
            for r in rows))
    variants = load(out / "variants.json")
    if variants:
        results = variants["results"]
        base = next((r for r in results if r["name"] == "default" and "step_s" in r), None)
        if base:
            lines.append("variants (speed-up over default): " + "; ".join(
                f"{r['name']} {base['step_s'] / r['step_s']:.3f}x" if "step_s" in r
                else f"{r['name']} error" for r in results if r["name"] != "default"))
        lines.append(f"winners: {variants.get('winners') or 'none'}")
    lines += annotate_lines(load(out / "annotate.json"))
    index = load(out / "index.json")
    for r in (index or {}).get("rows", []):
        lines.append(f"MINER index ({r['images']:,} x (1 + {r['crops']}) x {r['dim']}, re-rank "
                     f"on {r['backend']}): calibrated M {str(r['shortlist']).split(' (')[0]}, "
                     f"lists {r['nprobe']}: "
                     f"recall@10 {r['recall10']:.3f} of the exact order, {r['q_per_s']:,.0f} "
                     f"queries/s ({r['q_per_s'] / index['exact_q_per_s']:.0f}x the exact "
                     f"search)")
    stages = [json.loads(line) for line in open(out / "stages.jsonl")] \
        if (out / "stages.jsonl").exists() else []
    lines.append("stages: " + "; ".join(f"{s['stage']} {s['status']} in {s['seconds']} s"
                                        for s in stages))
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    print(render(Path(argv[0])))


if __name__ == "__main__":
    main()
