"""bench/gpu_session.sh end to end on the CPU with the tiny preset (its five stages on the demo
recipe; one run, module-scoped): the profile's table (bench/gpu_profile.py) checked against
XLA's own counts, the variants, the timed start and resume of the trainer, the resident CSLS,
the annotation stages on tiny models, the summary table printed last; and the GPU side of the
profile's analysis on a small synthetic trace and HLO module written here."""

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import own_cache_env
from jax._src.lib import _jax
from jaxlib import _hlo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_profile  # noqa: E402
import gpu_profile_analysis as analysis  # noqa: E402

STEPS = 2  # the profile's traced steps in --tiny


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """(stdout, output folder) of `bash bench/gpu_session.sh --tiny`."""
    out = tmp_path_factory.mktemp("gpu_session")
    # the stages run this interpreter; the run stage times a cold start: the script's own cache.
    # XLA:CPU compiles with the suite's cheap-compile flags (conftest.py, in XLA_FLAGS; the
    # profile reads whatever thunks XLA made): the session's three cold compiles cost less
    env = own_cache_env(SCLARO_PYTHON=sys.executable)
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh"), "--tiny",
                             "--out", str(out)], capture_output=True, text=True, timeout=1200,
                            env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, out


@pytest.fixture(scope="module")
def tiny(session):
    """(report, output folder) of the session's profile stage."""
    out = session[1] / "profile"
    return json.loads((out / "profile.json").read_text()), out


@pytest.mark.slow
def test_every_stage_ran_and_the_summary_is_printed_last(session):
    stdout, out = session
    stages = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    assert [(s["stage"], s["status"]) for s in stages] == [
        ("profile", "0"), ("variants", "0"), ("run", "0"), ("miner", "0"), ("annotate", "0"),
        ("index", "0")]
    summary = (out / "summary.md").read_text().strip()
    assert stdout.strip().endswith(summary)
    for target in ("real-data examples/s", "useful MFU", "compile, every executable",
                   "first loss after start", "CSLS resident"):
        line = next(line for line in summary.splitlines() if target in line)
        if "authors' torch" not in line:  # their GPU code runs on a GPU only
            assert "not measured" not in line, line


@pytest.mark.slow
def test_variants_give_the_default_numbers_and_the_run_takes_the_winners(session):
    _, out = session
    results = {r["name"]: r for r in json.loads((out / "variants.json").read_text())["results"]}
    assert set(results) == {"default", "fused_qkv"}
    for name, r in results.items():
        assert r["step_s"] > 0 and r["examples_per_sec"] > 0 and r["compile_s"] >= 0, name
        assert r["losses"] == pytest.approx(results["default"]["losses"], rel=1e-5), name
    winners = json.loads((out / "variants.json").read_text())["winners"]
    assert json.loads((out / "run.json").read_text())["perf"]["fused_qkv"] == \
        winners.get("fused_qkv", False)


@pytest.mark.slow
def test_the_run_compiles_cold_then_resumes_warm_and_reports_its_throughput(session):
    _, out = session
    run = json.loads((out / "run.json").read_text())
    cold, warm = run["starts"]["cold"], run["starts"]["warm"]
    assert cold["executables"] == warm["executables"] == 1
    assert cold["first_step"] == 1 and warm["first_step"] > 1  # stopped, then resumed
    assert cold["first_loss_after_start_s"] > cold["compile_s"] > 0
    assert warm["first_loss_after_start_s"] > 0
    # the warm start loads its executable from the cache the cold one wrote
    assert warm["compile_s"] < cold["compile_s"]
    assert run["steps_timed"] > 0 and run["examples_per_sec"] > 0
    assert 0 < run["useful_tflops_per_step"] <= run["tflops_per_step"]
    assert 0 < run["useful_mfu"] <= run["mfu"]
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").open()]
    assert metrics[-1]["step"] == 16
    # its useful FLOPs: the variants stage's line of the recipe's default step, taken as it is
    line = json.loads((out / "variants.json").read_text())["useful_flops"]
    assert run["useful_flops"] == {**line, "from": str(out / "variants.json")}
    assert line["base"] > 0 and line["slope_objects"] > 0 and line["slope_relations"] > 0


def test_the_run_reports_take_a_useful_flops_line_or_lower_their_own(tmp_path):
    """bench_run_start.py's `--useful-flops-from`: the line a variants JSON records, or None
    (the run's step is lowered for it) when the file is missing, unreadable or has none."""
    from bench_run_start import UsefulLine, useful_line_of

    line = UsefulLine(base=100.0, slope_objects=2.0, slope_relations=3.0, crops=16)
    assert line(16, 16) == 100.0 and line(20, 10) == 100.0 + 2.0 * 4 - 3.0 * 6
    recorded = tmp_path / "variants.json"
    recorded.write_text(json.dumps({"results": [], "useful_flops": {
        "base": 100.0, "slope_objects": 2.0, "slope_relations": 3.0, "crops": 16}}))
    assert useful_line_of(str(recorded)) == line
    (tmp_path / "none.json").write_text(json.dumps({"results": []}))  # stopped before it
    (tmp_path / "torn.json").write_text('{"results": [')
    for path in ("none.json", "torn.json", "missing.json"):
        assert useful_line_of(str(tmp_path / path)) is None, path


@pytest.mark.slow
def test_the_resident_csls_row(session):
    _, out = session
    (row,) = json.loads((out / "miner.json").read_text())
    assert row["backend"] == "cpu" and row["theirs"] is None
    assert row["ours_ms"] > 0 and row["copy_gb_s"] > 0


@pytest.mark.slow
def test_the_index_stage_searches_at_the_settings_its_build_calibrated(session):
    """bench/bench_miner_index.py in the session: one row, the calibrated settings, their
    recall@10 against the exact order of queries not in the bank, and the summary's line."""
    stdout, out = session
    report = json.loads((out / "index.json").read_text())
    (row,) = report["rows"]
    assert row["calibrated"] and row["backend"] == "cpu"
    assert (row["images"], row["crops"], row["dim"], row["queries"]) == (3000, 3, 32, 200)
    assert row["recall10"] >= 0.9 and row["q_per_s"] > 0 and report["exact_q_per_s"] > 0
    assert str(row["shortlist"]).endswith("(calibrated)")
    line = next(line for line in stdout.splitlines() if line.startswith("MINER index"))
    assert f"recall@10 {row['recall10']:.3f} of the exact order" in line
    assert not list(out.glob("**/views.npy"))  # the gallery and index stay out of OUT


@pytest.mark.slow
def test_the_annotate_stage_times_each_stage_switch_and_the_pipeline(session):
    """bench/bench_annotate_gpu.py --tiny: the demo photographs through the tiny models."""
    from data_prep.demo import load_annotations
    stdout, out = session
    report = json.loads((out / "annotate.json").read_text())
    assert (report["form"], report["device"], report["batches"]) == ("tiny", "cpu", [2, 4])
    assert {(r["batch"], r["static_cache"]) for r in report["vlm"]} == {
        (2, False), (2, True), (4, False), (4, True)}
    for r in report["vlm"]:  # at most new_tokens a row, padding included
        assert 0 < r["tokens_per_s"] <= r["images_per_s"] * r["new_tokens"] * (1 + 1e-9)
    assert {(r["batch"], r["switch"]) for r in report["detect"]} == {
        (2, "default"), (4, "default"), (2, "detector_text_once"), (2, "bf16")}
    segmenter = [r for r in report["segment"] if r["what"] == "segmenter"]
    assert [r["switch"] for r in segmenter] == ["default", "sam_sdpa", "bf16"]
    # the demo's own boxes of the block's photographs
    boxes = [len(e["objects"]) for e in load_annotations()[:2]]
    assert {r["boxes_per_image"] for r in segmenter} == {sum(boxes) / 2}
    assert [r["batch"] for r in report["segment"] if r["what"] == "image_encoder"] == [1, 2]
    for r in report["vlm"] + report["detect"] + report["segment"]:
        assert r["images_per_s"] == pytest.approx(r["batch"] / r["seconds"], rel=1e-3) or \
            r.get("what") == "segmenter"
        assert r["peak_gb"] == "n/a on CPU"
    pipe = report["pipeline"]
    assert pipe["images"] == 4 and 0 < pipe["kept"] <= 4
    assert pipe["images_per_s"] == pytest.approx(4 / pipe["seconds"], rel=1e-3)
    assert pipe["device_hours_per_100k"] == pytest.approx(1e5 / pipe["images_per_s"] / 3600)
    assert set(pipe["stage_images_per_s"]) == {"vlm", "detect", "segment"}
    assert pipe["overlapped_bound_images_per_s"] == min(pipe["stage_images_per_s"].values())
    # the stages run one after another: the pipeline is no faster than its slowest stage
    assert pipe["images_per_s"] <= pipe["overlapped_bound_images_per_s"]
    summary = (out / "summary.md").read_text()
    assert "annotate (tiny, cpu)" in summary and "annotate pipeline" in summary
    assert "sam_sdpa (segment)" in summary and "vlm_static_cache" in summary


def xla_flops(hlo_text: str, opcodes: list) -> float:
    """XLA's own cost analysis restricted to instructions of `opcodes`: each of the module
    (parsed by XLA) alone in a module of its own, with parameters for its operands. Each is
    counted once, which holds where none sits in a loop or under a conditional."""
    client = jax.devices("cpu")[0].client
    total = 0.0
    for computation in _hlo.hlo_module_from_text(hlo_text).computations():
        for inst in computation.instructions():
            if inst.opcode not in opcodes:
                continue
            params = [op.to_string().split(" = ") for op in inst.operands()]
            lines = [f"{name} = {rest.split()[0]} parameter({i})"
                     for i, (name, rest) in enumerate(params)]
            # metadata names stack frames this module does not have
            lines.append("ROOT " + re.sub(r", metadata=\{[^}]*\}", "", inst.to_string()))
            one = _hlo.hlo_module_from_text("HloModule one\nENTRY e {\n" + "\n".join(lines)
                                            + "\n}\n")
            total += _jax.hlo_module_cost_analysis(client, one)["flops"]
    return total


def rows(report):
    return {r["kind"]: r for r in report["rows"]}


@pytest.mark.slow
def test_every_kind_is_a_row_and_the_shares_add_up_to_the_step(tiny):
    report, out = tiny
    assert [r["kind"] for r in report["rows"]] == list(analysis.KINDS)
    assert sum(r["share"] for r in report["rows"]) == pytest.approx(1.0, abs=1e-9)
    assert sum(r["ms"] for r in report["rows"]) == pytest.approx(report["summary"]["step_ms"])
    # the printed shares too, each rounded to 0.1%
    md = (out / "profile.md").read_text()
    printed = [float(line.split("|")[3].strip().rstrip("%")) for line in md.splitlines()
               if line.startswith("| ") and not line.startswith(("| kind", "| total"))]
    assert len(printed) == len(analysis.KINDS)
    assert sum(printed) == pytest.approx(100.0, abs=0.05 * len(printed))


@pytest.mark.slow
def test_optimizer_attention_and_gemm_rows_have_work(tiny):
    by_kind = rows(tiny[0])
    for kind in ("gemm", "attention", "optimizer", "augment"):
        assert by_kind[kind]["ms"] > 0 and by_kind[kind]["gb"] > 0, kind
    for kind in analysis.MATMUL_KINDS:
        assert by_kind[kind]["gflop"] > 0 and by_kind[kind]["tflops"] > 0
        assert 0 < by_kind[kind]["of_ceiling"], kind
    assert by_kind["gaps"]["gflop"] is None and by_kind["optimizer"]["gflop"] is None


@pytest.mark.slow
def test_flops_match_xlas_count_of_the_dots_that_ran(tiny):
    """The tool's FLOPs (its own parse of the HLO text, fusion bodies, execution counts)
    against XLA's cost analysis of the same instructions: equal to rounding. The step's dots
    are in the matmul rows; the augmentation's blur (a convolution) counts in the total."""
    report, out = tiny
    hlo = (out / report["run"]["hlo"][0]).read_text()
    by_kind = rows(report)
    matmul = (by_kind["gemm"]["gflop"] + by_kind["attention"]["gflop"]) * 1e9
    assert matmul == pytest.approx(xla_flops(hlo, [_hlo.HloOpcode.kDot]), rel=1e-9)
    assert report["summary"]["tflop_per_step"] * 1e12 == pytest.approx(
        xla_flops(hlo, [_hlo.HloOpcode.kDot, _hlo.HloOpcode.kConvolution]), rel=1e-9)


@pytest.mark.slow
def test_the_trace_maps_to_the_module_that_ran(tiny):
    report, _ = tiny
    summary = report["summary"]
    assert summary["event_modules"] == summary["modules"] == ["jit_step"]
    assert summary["events_per_step"] > 100
    assert summary["unmapped_events"] <= 0.01 * summary["events_per_step"] * STEPS
    assert "," not in report["run"]["packed_sizes"]  # one size: "K object + L relation slots"


@pytest.mark.slow
def test_output_folder_and_from_trace_give_the_same_numbers(tiny, tmp_path, capsys):
    saved, out = tiny
    assert (out / saved["run"]["trace"]).exists()
    assert (out / saved["run"]["hlo"][0]).read_text().startswith("HloModule jit_step")
    # the command's entry point with its arguments, in this process (--from-trace runs nothing)
    gpu_profile.main(["--from-trace", str(out), "--out", str(tmp_path)])
    assert json.loads((tmp_path / "profile.json").read_text()) == saved
    table = (out / "profile.md").read_text().strip()
    assert capsys.readouterr().out.strip().endswith(table)  # the table printed last


# ------------------------------------------------------------------ GPU trace, synthetic

GEMM = ('"gemm_backend_config":{{"alpha_real":1,"beta":0,"dot_dimension_numbers":{{'
        '"lhs_contracting_dimensions":[{lc}],"rhs_contracting_dimensions":[{rc}],'
        '"lhs_batch_dimensions":[{lb}],"rhs_batch_dimensions":[{rb}]}},"epilogue":"DEFAULT"}}')

GPU_HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[256,768]{1,0})->f32[256]{0}}

%fused_add (param_0: f32[256,768], param_1: f32[256,768]) -> f32[256,768] {
  %param_0 = f32[256,768]{1,0} parameter(0)
  %param_1 = f32[256,768]{1,0} parameter(1)
  ROOT %add.1 = f32[256,768]{1,0} add(f32[256,768]{1,0} %param_0, f32[256,768]{1,0} %param_1), metadata={op_name="jit(step)/jvp()/add"}
}

%region_sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

%fused_reduce (param_0.1: f32[256,768]) -> f32[256] {
  %param_0.1 = f32[256,768]{1,0} parameter(0)
  %constant.1 = f32[] constant(0)
  ROOT %reduce.1 = f32[256]{0} reduce(f32[256,768]{1,0} %param_0.1, f32[] %constant.1), dimensions={1}, to_apply=%region_sum, metadata={op_name="jit(step)/jvp()/reduce_sum"}
}

%fused_adam (param_0.2: f32[768,768], param_1.2: f32[768,768]) -> f32[768,768] {
  %param_0.2 = f32[768,768]{1,0} parameter(0)
  %param_1.2 = f32[768,768]{1,0} parameter(1)
  ROOT %multiply.2 = f32[768,768]{1,0} multiply(f32[768,768]{1,0} %param_0.2, f32[768,768]{1,0} %param_1.2), metadata={op_name="jit(step)/optimizer/mul"}
}

%gemm_fusion_dot_computation (param_0.3: bf16[8,12,50,64], param_1.3: bf16[8,12,50,64]) -> f32[8,12,50,50] {
  %param_0.3 = bf16[8,12,50,64]{3,2,1,0} parameter(0)
  %param_1.3 = bf16[8,12,50,64]{3,2,1,0} parameter(1)
  ROOT %dot.5 = f32[8,12,50,50]{3,2,1,0} dot(bf16[8,12,50,64]{3,2,1,0} %param_0.3, bf16[8,12,50,64]{3,2,1,0} %param_1.3), lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}, rhs_contracting_dims={3}, metadata={op_name="jit(step)/jvp(attention_core)/bhqd,bhkd->bhqk/dot_general"}
}

%wrapped_transpose_computation (param_0.4: f32[768,256]) -> f32[256,768] {
  %param_0.4 = f32[768,256]{1,0} parameter(0)
  ROOT %transpose.1 = f32[256,768]{1,0} transpose(f32[768,256]{1,0} %param_0.4), dimensions={1,0}
}

%command_buffer (p0: f32[256,768], p1: bf16[256,768], p2: bf16[768,3072], p3: bf16[96,50,50], p4: bf16[96,50,64], p5: f32[768,768], p6: bf16[8,12,50,64], p7: f32[768,256]) -> (f32[256], f32[768,768]) {
  %p0 = f32[256,768]{1,0} parameter(0)
  %p1 = bf16[256,768]{1,0} parameter(1)
  %p2 = bf16[768,3072]{1,0} parameter(2)
  %p3 = bf16[96,50,50]{2,1,0} parameter(3)
  %p4 = bf16[96,50,64]{2,1,0} parameter(4)
  %p5 = f32[768,768]{1,0} parameter(5)
  %p6 = bf16[8,12,50,64]{3,2,1,0} parameter(6)
  %p7 = f32[768,256]{1,0} parameter(7)
  %cublas-gemm.1 = (bf16[256,3072]{1,0}, s8[4194304]{0}) custom-call(bf16[256,768]{1,0} %p1, bf16[768,3072]{1,0} %p2), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/jvp()/dot_general"}, backend_config={"operation_queue_id":"0",GEMM1}
  %cublas-gemm.2 = (bf16[96,50,64]{2,1,0}, s8[4194304]{0}) custom-call(bf16[96,50,50]{2,1,0} %p3, bf16[96,50,64]{2,1,0} %p4), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(attention_core))/bhqk,bhkd->bhqd/dot_general"}, backend_config={"operation_queue_id":"0",GEMM2}
  %loop_add_fusion = f32[256,768]{1,0} fusion(f32[256,768]{1,0} %p0, f32[256,768]{1,0} %p0), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/jvp()/add"}
  %input_reduce_fusion.2 = f32[256]{0} fusion(f32[256,768]{1,0} %loop_add_fusion), kind=kInput, calls=%fused_reduce, metadata={op_name="jit(step)/jvp()/reduce_sum"}
  %loop_multiply_fusion.3 = f32[768,768]{1,0} fusion(f32[768,768]{1,0} %p5, f32[768,768]{1,0} %p5), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(step)/optimizer/mul"}
  %gemm_fusion_dot.4 = f32[8,12,50,50]{3,2,1,0} fusion(bf16[8,12,50,64]{3,2,1,0} %p6, bf16[8,12,50,64]{3,2,1,0} %p6), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %wrapped_transpose.5 = f32[256,768]{1,0} fusion(f32[768,256]{1,0} %p7), kind=kInput, calls=%wrapped_transpose_computation
  ROOT %tuple.1 = (f32[256], f32[768,768]{1,0}) tuple(f32[256]{0} %input_reduce_fusion.2, f32[768,768]{1,0} %loop_multiply_fusion.3)
}

%fused_blend (param_0.6: u8[16,32,32,3]) -> u8[16,32,32,3] {
  %param_0.6 = u8[16,32,32,3]{3,2,1,0} parameter(0)
  ROOT %negate.6 = u8[16,32,32,3]{3,2,1,0} negate(u8[16,32,32,3]{3,2,1,0} %param_0.6), metadata={op_name="jit(step)/jvp(augment)/neg"}
}

%blend_body (state: (s32[], u8[16,32,32,3])) -> (s32[], u8[16,32,32,3]) {
  %state = (s32[], u8[16,32,32,3]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], u8[16,32,32,3]{3,2,1,0}) %state), index=0
  %views = u8[16,32,32,3]{3,2,1,0} get-tuple-element((s32[], u8[16,32,32,3]{3,2,1,0}) %state), index=1
  %loop_convert_fusion = u8[16,32,32,3]{3,2,1,0} fusion(u8[16,32,32,3]{3,2,1,0} %views), kind=kLoop, calls=%fused_blend, metadata={op_name="jit(step)/jvp(augment)/neg"}
  ROOT %next = (s32[], u8[16,32,32,3]{3,2,1,0}) tuple(s32[] %i, u8[16,32,32,3]{3,2,1,0} %loop_convert_fusion)
}

%blend_condition (state.1: (s32[], u8[16,32,32,3])) -> pred[] {
  %state.1 = (s32[], u8[16,32,32,3]{3,2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element((s32[], u8[16,32,32,3]{3,2,1,0}) %state.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(s32[] %i.1, s32[] %three), direction=LT
}

ENTRY %main.9 (Arg_0: f32[256,768], Arg_1: bf16[8,50,12,64], Arg_2: u8[16,32,32,3]) -> f32[256] {
  %Arg_0 = f32[256,768]{1,0} parameter(0)
  %Arg_1 = bf16[8,50,12,64]{3,2,1,0} parameter(1)
  %Arg_2 = u8[16,32,32,3]{3,2,1,0} parameter(2)
  %call.6 = (f32[256], f32[768,768]{1,0}) call(f32[256,768]{1,0} %Arg_0), to_apply=%command_buffer
  %custom-call.7 = (bf16[8,50,12,64]{3,2,1,0}, u8[0]{0}) custom-call(bf16[8,50,12,64]{3,2,1,0} %Arg_1, bf16[8,50,12,64]{3,2,1,0} %Arg_1, bf16[8,50,12,64]{3,2,1,0} %Arg_1), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/jvp()/dot_product_attention"}
  %copy.8 = f32[256,768]{0,1} copy(f32[256,768]{1,0} %Arg_0)
  %zero = s32[] constant(0)
  %init = (s32[], u8[16,32,32,3]{3,2,1,0}) tuple(s32[] %zero, u8[16,32,32,3]{3,2,1,0} %Arg_2)
  %while.9 = (s32[], u8[16,32,32,3]{3,2,1,0}) while((s32[], u8[16,32,32,3]{3,2,1,0}) %init), condition=%blend_condition, body=%blend_body, metadata={op_name="jit(step)/jvp(augment)/while"}, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %gte = f32[256]{0} get-tuple-element((f32[256], f32[768,768]{1,0}) %call.6), index=0
}
""".replace("GEMM1", GEMM.format(lc='"1"', rc='"0"', lb="", rb="")).replace(
    "GEMM2", GEMM.format(lc='"2"', rc='"1"', lb='"0"', rb='"0"'))

# (stream, start µs within the step, duration µs, kernel name, args); each step lasts 90 µs
# and the next starts 10 µs later: the device waits for the host.
STEP_EVENTS = [
    (7, 0, 40, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
     {"hlo_op": "cublas-gemm.1"}),
    # a cuBLAS kernel inside the command buffer: its op is the buffer's call
    (7, 40, 10, "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", {"hlo_op": "call.6"}),
    (7, 50, 5, "loop_add_fusion", {}),
    (7, 55, 5, "input_reduce_fusion_2", {"hlo_op": "call.6"}),
    (7, 60, 4, "loop_multiply_fusion_3", {"hlo_op": "call.6"}),
    (7, 64, 6, "gemm_fusion_dot_4", {"hlo_op": "call.6"}),
    (7, 70, 8, "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x64x64_4x1x1_kernel0_0",
     {"hlo_op": "custom-call.7"}),
    (7, 78, 2, "wrapped_transpose_5", {}),
    (9, 78, 2, "MemcpyD2D", {"hlo_op": "copy.8"}),  # with the transpose: 1 µs each
    (7, 80, 2, "loop_convert_fusion", {"hlo_op": "while.9"}),
    (7, 82, 2, "loop_convert_fusion", {"hlo_op": "while.9"}),
    (7, 84, 2, "loop_convert_fusion", {"hlo_op": "while.9"}),
    (9, 86, 1, "Memset", {}),
    (7, 87, 3, "some_library_kernel", {}),
]
# µs per step by kind, and how much of it came from kernel names alone
EXPECTED_US = {"gemm": 50, "attention": 14, "elementwise": 5, "reduction": 5, "optimizer": 4,
               "augment": 6, "copy": 3, "other": 3, "gaps": 5}
EXPECTED_PATTERN_US = {"gemm": 10, "copy": 1, "other": 3}


def gpu_trace() -> dict:
    meta = [("process_name", 1, None, "/device:GPU:0"), ("process_name", 701, None, "/host:CPU"),
            ("thread_name", 1, 7, "Stream #7(Compute)"), ("thread_name", 1, 9,
                                                          "Stream #9(MemcpyD2D,Memset)"),
            ("thread_name", 1, 100, "XLA Ops"), ("thread_name", 701, 5, "python")]
    events = [{"ph": "M", "pid": pid, "name": name, "args": {"name": value},
               **({"tid": tid} if tid is not None else {})} for name, pid, tid, value in meta]
    for step in range(STEPS):
        t0 = 1000.0 + 100 * step
        events += [{"ph": "X", "pid": 1, "tid": tid, "ts": t0 + ts, "dur": dur, "name": name,
                    "args": {"hlo_module": "jit_step", "correlation_id": "1", **args}}
                   for tid, ts, dur, name, args in STEP_EVENTS]
        # the same work again on other lines: to be left out
        events += [{"ph": "X", "pid": 1, "tid": 100, "ts": t0, "dur": 90, "name": "call.6",
                    "args": {"hlo_op": "call.6"}},
                   {"ph": "X", "pid": 701, "tid": 5, "ts": t0 - 50, "dur": 20,
                    "name": "ThunkExecutor", "args": {"hlo_op": "call.6"}}]
    return {"displayTimeUnit": "ns", "traceEvents": events}


def test_gpu_trace_kernels_map_by_name_op_or_kernel_pattern(tmp_path):
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(gpu_trace(), f)
    attr = analysis.attribute(analysis.load_trace(path), [analysis.Module(GPU_HLO)], STEPS)
    assert attr["lines"] == ["Stream #7(Compute)", "Stream #9(MemcpyD2D,Memset)"]
    assert attr["window_ms"] == pytest.approx(0.095)  # 190 µs over 2 steps
    for kind in analysis.KINDS:
        assert attr["kinds"][kind]["ms"] * 1e3 == pytest.approx(EXPECTED_US[kind]), kind
        assert attr["kinds"][kind]["pattern_ms"] * 1e3 == pytest.approx(
            EXPECTED_PATTERN_US.get(kind, 0)), kind
    assert attr["events"] == len(STEP_EVENTS) * STEPS
    assert attr["unmapped_events"] == 3 * STEPS  # nvjet in the buffer, Memset, the unknown one
    flops = {k: attr["kinds"][k]["flops"] for k in analysis.KINDS}
    assert flops["gemm"] == 2 * 256 * 3072 * 768  # cublas-gemm.1
    # cublas-gemm.2 (weights.v) and the Triton q.k fusion; cuDNN's fused attention uncounted
    assert flops["attention"] == 2 * 96 * 50 * 64 * 50 + 2 * 8 * 12 * 50 * 50 * 64
    assert attr["uncounted_flops_calls"] == 1
    # the blend fusion runs in a while loop of 3 trips: input + output bytes, 3 times
    assert attr["kinds"]["augment"]["bytes"] == 3 * 2 * 16 * 32 * 32 * 3
    # a cuBLAS call's bytes leave out its scratch space
    gemm_bytes = 2 * (256 * 768 + 768 * 3072 + 256 * 3072)
    assert attr["kinds"]["gemm"]["bytes"] == gemm_bytes
    assert attr["matmul_shapes"]["gemm"] == [
        {"shape": [1, 256, 3072, 768], "dtypes": ["bf16", "bf16", "bf16"],
         "ms": pytest.approx(0.04), "flops": 2 * 256 * 3072 * 768}]
    # by time (the Triton fusion's kernel was mapped), then by FLOPs
    assert [m["shape"] for m in attr["matmul_shapes"]["attention"]] == [
        [96, 50, 50, 64], [96, 50, 64, 50]]

    ceilings = {"matmul": [{"shape": [1, 256, 3072, 768], "dtypes": ["bf16"] * 3,
                            "tflops": 500.0}], "stream_gbs": 4000.0, "stream_bytes": 2 ** 31}
    report = analysis.report(attr, {"batch": 128, "steps": STEPS, "ceilings": ceilings})
    by_kind = rows(report)
    assert by_kind["gemm"]["tflops"] == pytest.approx(2 * 256 * 3072 * 768 / 50e-6 / 1e12)
    assert by_kind["gemm"]["of_ceiling"] == pytest.approx(by_kind["gemm"]["tflops"] / 500)
    assert by_kind["copy"]["of_ceiling"] == pytest.approx(by_kind["copy"]["gbs"] / 4000)
    assert by_kind["attention"]["of_ceiling"] is None  # none of its shapes measured
    assert report["summary"]["examples_per_sec"] == pytest.approx(128 / 95e-6)
    assert "| host gaps (device idle) | 0.005 | 5.3% |" in analysis.table(report)


def test_overlapping_events_share_time_nested_on_threads_side_by_side_on_streams():
    loop = {"pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0}
    body = {"pid": 1, "tid": 1, "ts": 2.0, "dur": 2.0}
    other = {"pid": 1, "tid": 2, "ts": 12.0, "dur": 4.0}
    # a CPU thread: the loop's thunk holds its body's time
    assert analysis.shared_time([loop, body, other], nested=True) == ([8.0, 2.0, 4.0], 2.0, 16.0)
    # a GPU stream: kernels running at once share it
    assert analysis.shared_time([loop, body, other], nested=False) == ([9.0, 1.0, 4.0], 2.0, 16.0)


def test_device_lines_streams_first_else_all_but_the_repeating_ones():
    def trace(lines):
        meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
        meta += [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": n}}
                 for tid, n in enumerate(lines)]
        return {"traceEvents": meta + [{"ph": "X", "pid": 1, "tid": tid, "ts": 0, "dur": 1,
                                        "name": "k"} for tid in range(len(lines))]}

    events, lines, nested = analysis.device_events(trace(["XLA Ops", "Stream #7(Compute)"]))
    assert (len(events), lines, nested) == (1, ["Stream #7(Compute)"], False)
    events, lines, _ = analysis.device_events(trace(["XLA Modules", "XLA Ops", "Kernels"]))
    assert (len(events), lines) == (1, ["Kernels"])


def test_a_failed_analysis_keeps_the_trace_hlo_and_ceilings(tmp_path, monkeypatch):
    """Should the analysis fail on a trace (a GPU session is short), the folder still holds
    what --from-trace needs and the ceilings, measured at the HLO's matmul shapes."""
    import numpy as np

    from sclaro_jax.run.ahead import CompiledSteps

    jitted = jax.jit(lambda state, batch: ({"w": state["w"] * 0.5},
                                           {"y": (batch["image"] @ state["w"]).sum()}),
                     donate_argnums=0)
    state = jax.device_put({"w": jax.numpy.ones((16, 8))})
    step = CompiledSteps(jitted, state, [{"image": ((4, 16), np.dtype(np.float32))}])
    monkeypatch.setattr(gpu_profile, "attribute", lambda *a: 1 / 0)
    with pytest.raises(SystemExit, match="--from-trace"):
        gpu_profile.profile(step, state, [{"image": np.ones((4, 16), np.float32)}], tmp_path,
                            steps=1, warmup=1)
    run = json.loads((tmp_path / "profile.json").read_text())["run"]
    assert (tmp_path / run["trace"]).exists() and (tmp_path / run["hlo"][0]).exists()
    assert [m["shape"] for m in run["ceilings"]["matmul"]] == [[1, 4, 8, 16]]
    assert run["ceilings"]["stream_gbs"] > 0
    monkeypatch.undo()
    assert gpu_profile.from_trace(tmp_path)["summary"]["tflop_per_step"] == 2 * 4 * 8 * 16 / 1e12
