"""The analysis behind `gpu_profile.py`: a `jax.profiler` trace of a jitted step matched against
the step's optimized HLO text (`compiled.as_text()`), as time, FLOPs and bytes per step by kind
of work. No JAX is run here, so a trace taken on a GPU can be read again on any machine.

Device events: on a GPU the kernels, memcpys and memsets on the device's stream lines ("Stream
#N(...)" threads of a "/device:..." process; lines such as "XLA Ops" repeat them); on the CPU
the thunks XLA:CPU runs (host events carrying `hlo_op`). Each event is matched to an HLO
instruction by its name (XLA:GPU names a fusion's kernel after the instruction, "." and "-"
made "_"), else by its `hlo_op` argument, unless that names a `call`: a kernel run inside a
command buffer carries the buffer's call, not its own op. Events matched to nothing (cuBLAS /
cuDNN kernels inside a command buffer, memcpys) get their kind from the kernel name and are
counted as unmapped. A kind's time is its events' time; where events overlap (GPU streams, CPU
threads) each instant is shared equally among the events running then (on a CPU thread, the
innermost: a loop's thunk holds its body's), and instants inside the steps' window where none
runs are host gaps, so the rows add up to the window.

FLOPs and bytes per step are counted from the HLO, each executed instruction (a fusion as a
whole) as many times as a step runs it: while bodies by their known trip count, conditional
branches equally weighted. FLOPs: 2 x output elements x contracted size for every dot (cuBLAS
calls: dimension numbers from backend_config) and 2 x output elements x kernel window for
convolutions; cuDNN fused attention is left uncounted (the number of such calls is reported).
Bytes: operand + output sizes of the instruction.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections import defaultdict

from sclaro_jax.models.layers import ATTENTION_SCOPE
from sclaro_jax.train.core import AUGMENT_SCOPE, EMA_SCOPE, OPTIMIZER_SCOPE

KINDS = {  # key: row label, in table order
    "gemm": "GEMMs (matmuls outside attention's core)",
    "attention": "attention core (q.k, softmax, weights.v)",
    "elementwise": "elementwise fusions (LayerNorm apply, activations, casts, ...)",
    "reduction": "reductions (LayerNorm statistics, loss sums, ...)",
    "optimizer": "optimiser + EMA",
    "augment": "photometric augmentation",
    "copy": "copies / transposes",
    "other": "other",
    "gaps": "host gaps (device idle)",
}
MATMUL_KINDS = ("gemm", "attention")
MEMORY_KINDS = ("elementwise", "reduction", "optimizer", "augment", "copy")
# A dot's scope decides first, then the instruction's (order: precedence).
SCOPES = ((ATTENTION_SCOPE, "attention"), (OPTIMIZER_SCOPE, "optimizer"), (EMA_SCOPE, "optimizer"),
          (AUGMENT_SCOPE, "augment"))

TRIVIAL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
           "opt-barrier", "add-dependency", "domain", "async-done", "async-update"}
CONTROL = {"while", "conditional", "call", "async-start"}
REDUCE = {"reduce", "reduce-window", "all-reduce", "reduce-scatter"}
MOVE = {"copy", "copy-start", "copy-done", "transpose", "reshape", "broadcast", "slice",
        "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "reverse", "gather", "iota"}
OTHER_OPS = {"custom-call", "scatter", "sort", "rng", "rng-bit-generator", "fft", "infeed",
             "outfeed", "send", "recv", "all-gather", "all-to-all", "collective-permute"}
# Kinds of events that name no instruction, by kernel name (first match wins).
KERNEL_PATTERNS = [
    (r"fmha|sdpa|flash|attention", "attention"),
    (r"gemm|nvjet|xmma|cutlass|cublas|matmul|splitkreduce", "gemm"),
    (r"^memcpy|^memset|copy|transpose", "copy"),
    (r"reduc", "reduction"),
    (r"fusion|elementwise", "elementwise"),
]
# Lines of a device that repeat its kernels (or annotate them) rather than add to them.
DERIVED = {"XLA Ops", "Async XLA Ops", "XLA Modules", "XLA TraceMe", "Steps", "Framework Ops",
           "Framework Name Scope", "Source code", "TensorFlow Ops", "TensorFlow Name Scope",
           "Launch Stats", "_counters_"}
BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
         "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
         "c128": 16}

HEADER = re.compile(r"^(ENTRY\s+)?%?(\S+)\s+\(.*\)\s*->.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _arrays(shape: str) -> list[tuple[str, list[int]]]:
    return [(dtype, [int(d) for d in re.findall(r"\d+", dims)])
            for dtype, dims in ARRAY.findall(shape)]


def _bytes(shape: str) -> float:
    return sum(BYTES.get(dtype, 1) * math.prod(dims) for dtype, dims in _arrays(shape)
               if dtype != "token")


def _dims(attrs: str, name: str) -> list[int]:
    """`name={1,2}` of an HLO attribute list, or `"name":["1","2"]` of a backend_config."""
    found = re.search(rf'\b{name}=\{{([\d,]*)\}}|"{name}":\[([^\]]*)\]', attrs)
    return [int(d) for d in re.findall(r"\d+", found.group(1) or found.group(2) or "")] \
        if found else []


def in_scope(op_name: str, scope: str) -> bool:
    """Whether a named scope is one of the op name's parts: "jit(step)/ema/...",
    "jit(step)/transpose(jvp(attention_core))/...", several names joined by ";"."""
    return re.search(rf"(^|[/;(]){re.escape(scope)}([/;)]|$)", op_name) is not None


class Inst:
    __slots__ = ("name", "shape", "opcode", "operands", "attrs")

    def __init__(self, match: re.Match):
        self.name, self.shape, self.opcode = match.group(2, 3, 4)
        rest, depth = match[5], 1
        for end, char in enumerate(rest):  # the operand list ends at the matching ")"
            depth += {"(": 1, ")": -1}.get(char, 0)
            if not depth:
                break
        self.operands = [part.split()[-1].lstrip("%") for part in _top_level(rest[:end])]
        self.attrs = rest[end + 1:]

    def attr(self, name: str) -> str:
        """An attribute's value: a computation (`calls=%c`), a quoted string (`op_name="..."`)
        or a bare word (`dim_labels=b01f_01io->b01f`)."""
        found = re.search(rf'\b{name}=(?:%([^\s,}}]+)|"((?:[^"\\]|\\.)*)"|([^\s,{{}}]+))',
                          self.attrs)
        return next((g for g in found.groups() if g), "") if found else ""

    @property
    def target(self) -> str:
        return self.attr("custom_call_target")


def _top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(char, 0)
        if char == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    return [p for p in parts + [text[start:]] if p.strip()]


class Module:
    """One HLO module's text: its computations, instructions by name, and each executed
    instruction's kind, FLOPs and bytes."""

    def __init__(self, text: str):
        self.name = re.match(r"HloModule\s+([^\s,]+)", text)[1]
        self.computations: dict[str, list[Inst]] = {}
        self.inst: dict[str, Inst] = {}
        self.entry, current = "", None
        for line in text.splitlines():
            if (header := HEADER.match(line)) is not None:
                current = self.computations.setdefault(header[2], [])
                self.entry = header[2] if header[1] else self.entry
            elif line.strip() == "}":
                current = None
            elif current is not None and (m := INSTRUCTION.match(line)) is not None:
                inst = Inst(m)
                current.append(inst)
                self.inst[inst.name] = inst
        # kernels XLA emits are named after their instruction, "." and "-" made "_"
        self.kernels = {re.sub(r"\W", "_", name): inst for name, inst in self.inst.items()}
        self.kernels.update(self.inst)
        self._kinds: dict[str, str] = {}

    def body(self, inst: Inst) -> list[Inst]:
        """What runs as `inst`: a fusion's instructions (nested fusions included), else itself."""
        if inst.opcode != "fusion":
            return [inst]
        return [i for sub in self.computations.get(inst.attr("calls"), []) for i in self.body(sub)]

    def shape(self, name: str) -> str:
        return self.inst[name].shape if name in self.inst else ""

    def dot_info(self, inst: Inst) -> tuple[float, tuple | None]:
        """(FLOPs, ((B, M, N, K), (lhs, rhs, out dtypes)) or None) of a dot, cuBLAS call or
        convolution (a convolution has no matmul shape). (0, None) where the operands' shapes
        are not in the text."""
        shapes = [_arrays(self.shape(o)) for o in inst.operands[:2]]
        if len(shapes) < 2 or not all(shapes):
            return 0.0, None
        (lhs_dtype, lhs), (rhs_dtype, rhs) = shapes[0][0], shapes[1][0]
        out_dtype, out_dims = _arrays(inst.shape)[0]
        out = math.prod(out_dims)
        if inst.opcode == "convolution" or inst.target.startswith("__cudnn$conv"):
            kernel_labels = inst.attr("dim_labels").split("_")[1].split("->")[0]
            return 2.0 * out * math.prod(rhs) / rhs[kernel_labels.index("o")], None
        suffix = "dims" if inst.opcode == "dot" else "dimensions"
        k = math.prod(lhs[d] for d in _dims(inst.attrs, f"lhs_contracting_{suffix}"))
        b = math.prod(lhs[d] for d in _dims(inst.attrs, f"lhs_batch_{suffix}"))
        m = math.prod(lhs) // (b * k)
        return 2.0 * out * k, ((b, m, out // (b * m), k), (lhs_dtype, rhs_dtype, out_dtype))

    def kind(self, inst: Inst) -> str:
        if inst.name not in self._kinds:
            self._kinds[inst.name] = self._classify(inst)
        return self._kinds[inst.name]

    def _classify(self, inst: Inst) -> str:
        body = self.body(inst)
        if any(i.target.startswith("__cudnn$fmha") for i in body):
            return "attention"
        dots = [i for i in body if _is_dot(i)]
        # a fusion's own op name is its root's; without one, any of its instructions' counts
        named = dots or ([inst] if inst.attr("op_name") else body)
        for scope, kind in SCOPES:
            if any(in_scope(i.attr("op_name"), scope) for i in named):
                return kind
        if dots:
            return "gemm"
        ops = {i.opcode for i in body} - TRIVIAL
        if not ops or ops & CONTROL or ops & OTHER_OPS:
            return "other"
        if ops & REDUCE:
            return "reduction"
        return "copy" if ops <= MOVE else "elementwise"

    def executed(self) -> dict[str, float]:
        """Instruction name -> times a run of the entry computation executes it (fusions and
        library calls as a whole; control flow walked into)."""
        counts: dict[str, float] = defaultdict(float)

        def walk(computation: str, times: float) -> None:
            for i in self.computations.get(computation, []):
                if i.opcode == "while":
                    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attrs)
                    n = int(trips[1]) if trips else 1
                    walk(i.attr("body"), times * n)
                    walk(i.attr("condition"), times * (n + 1))
                elif i.opcode == "conditional":
                    listed = re.search(r"branch_computations=\{([^}]*)\}", i.attrs)
                    branches = re.findall(r"%?([^\s,]+)", listed[1]) if listed else \
                        [i.attr("true_computation"), i.attr("false_computation")]
                    for branch in branches:
                        walk(branch, times / len(branches))
                elif i.opcode == "call":
                    walk(i.attr("to_apply"), times)
                elif i.opcode.endswith("-start") and i.attr("calls"):
                    walk(i.attr("calls"), times)
                elif i.opcode not in TRIVIAL:
                    counts[i.name] += times

        walk(self.entry, 1.0)
        return counts

    def cost(self, inst: Inst) -> tuple[float, float, list, int]:
        """(FLOPs, bytes, [(FLOPs, matmul shape)] of its dots, dots not counted) of one
        execution of `inst`."""
        body = self.body(inst)
        dots = [self.dot_info(i) for i in body if _is_dot(i)]
        uncounted = sum(f == 0 for f, _ in dots) + sum(
            i.target.startswith("__cudnn$fmha") for i in body)
        out = _arrays(inst.shape)
        if inst.opcode == "custom-call" and len(out) > 1 and out[-1][0] in ("s8", "u8"):
            out = out[:-1]  # a library call's scratch space, not data it moves
        size = sum(BYTES.get(t, 1) * math.prod(d) for t, d in out) + sum(
            _bytes(self.shape(o)) for o in inst.operands)
        return sum(f for f, _ in dots), size, [d for d in dots if d[1] is not None], uncounted


def _is_dot(inst: Inst) -> bool:
    return inst.opcode in ("dot", "convolution") or inst.target.startswith(
        ("__cublas", "__cudnn$conv"))


def load_trace(path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def device_events(trace: dict) -> tuple[list[dict], list[str], bool]:
    """(the trace's complete events that ran on the device, the names of their lines, whether
    an event on a line can hold others: host threads nest, device streams run side by side).
    A device's stream lines, else its lines but those that repeat them (`DERIVED`); without a
    device, the host events of XLA's thunks (they carry `hlo_op`)."""
    events = trace["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    devices = {e["pid"] for e in meta if e["name"] == "process_name"
               and e["args"]["name"].startswith("/device:")}
    lines = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
             if e["name"] == "thread_name" and e["pid"] in devices}
    done = [e for e in events if e.get("ph") == "X" and e.get("dur", 0) > 0]
    if not devices:
        return [e for e in done if "hlo_op" in e.get("args", {})], [], True
    keep = {k for k, name in lines.items() if name.startswith("Stream")} or {
        k for k, name in lines.items() if name not in DERIVED}
    return ([e for e in done if (e["pid"], e.get("tid")) in keep],
            sorted({lines[k] for k in keep}), False)


def resolve(event: dict, modules: dict[str, Module]) -> tuple[Module | None, Inst | None]:
    """The module and instruction an event ran (instruction None where it names none). An
    event without a known `hlo_module` is looked up in the only module there is."""
    args = event.get("args", {})
    module = modules.get(args.get("hlo_module", "")) or (
        next(iter(modules.values())) if len(modules) == 1 else None)
    if module is None:
        return None, None
    for name in (event["name"], args.get("long_name", "")):
        if name in module.kernels:
            return module, module.kernels[name]
    inst = module.inst.get(args.get("hlo_op", ""))
    return module, inst if inst is not None and inst.opcode != "call" else None


def kernel_kind(event: dict) -> str:
    name = f"{event['name']} {event.get('args', {}).get('long_name', '')}".lower()
    return next((kind for pattern, kind in KERNEL_PATTERNS if re.search(pattern, name)), "other")


def shared_time(events: list[dict], nested: bool) -> tuple[list[float], float, float]:
    """(µs each event is credited with, µs with no event running, window µs): each instant of
    the window is shared equally among the events running then; with `nested`, among the
    innermost running event of each thread (an outer one, a loop's, gets only its own time)."""
    # at one instant ends come first, and of events starting together the longer (outer) one
    bounds = sorted([(e["ts"] + e["dur"], 0, 0.0, i) for i, e in enumerate(events)]
                    + [(e["ts"], 1, -e["dur"], i) for i, e in enumerate(events)])
    credit, idle, stacks = [0.0] * len(events), 0.0, defaultdict(list)
    prev = bounds[0][0]
    for t, starts, _, i in bounds:
        tops = [stack[-1] for stack in stacks.values() if stack]
        for j in tops:
            credit[j] += (t - prev) / len(tops)
        if not tops:
            idle += t - prev
        prev = t
        stack = stacks[(events[i]["pid"], events[i].get("tid")) if nested else i]
        if starts:
            stack.append(i)
        else:
            stack.remove(i)
    return credit, idle, bounds[-1][0] - bounds[0][0]


def hlo_costs(modules: list[Module], inst_ms: dict | None = None,
              top: int = 3) -> tuple[dict, dict, float]:
    """From the HLO, per step: kind -> {"flops", "bytes"}; each matmul kind's `top` matmul
    shapes by their time in `inst_ms` ((module, instruction) -> ms per step), then by FLOPs;
    and the calls whose FLOPs are not counted."""
    inst_ms = inst_ms or {}
    kinds = {k: {"flops": 0.0, "bytes": 0.0} for k in KINDS}
    shapes: dict[str, dict] = {k: {} for k in MATMUL_KINDS}
    uncounted = 0.0
    for module in modules:
        for name, times in module.executed().items():
            inst = module.inst[name]
            kind, (flops, size, dots, missing) = module.kind(inst), module.cost(inst)
            kinds[kind]["flops"] += times * flops
            kinds[kind]["bytes"] += times * size
            uncounted += times * missing
            for dot_flops, shape in dots if kind in shapes else ():
                entry = shapes[kind].setdefault(json.dumps(shape), {"ms": 0.0, "flops": 0.0})
                entry["ms"] += inst_ms.get((module.name, name), 0.0) * dot_flops / flops
                entry["flops"] += times * dot_flops
    ranked = {k: [{"shape": json.loads(key)[0], "dtypes": json.loads(key)[1], **entry}
                  for key, entry in sorted(found.items(),
                                           key=lambda kv: (-kv[1]["ms"], -kv[1]["flops"]))][:top]
              for k, found in shapes.items()}
    return kinds, ranked, uncounted


def attribute(trace: dict, modules: list[Module], steps: int, top: int = 3) -> dict:
    """Per step: ms, FLOPs and bytes by kind, the device window, the events not mapped to an
    instruction, and each matmul kind's `top` matmul shapes (`hlo_costs`)."""
    modules = {m.name: m for m in modules}
    events, lines, nested = device_events(trace)
    if not events:
        raise ValueError("no device events in the trace (on a GPU: is CUPTI available?)")
    credit, idle, window = shared_time(events, nested)
    kinds = {k: {"ms": 0.0, "pattern_ms": 0.0} for k in KINDS}
    kinds["gaps"]["ms"] = idle / steps / 1e3
    inst_ms: dict[tuple[str, str], float] = defaultdict(float)
    unmapped = 0
    for event, us in zip(events, credit):
        module, inst = resolve(event, modules)
        if inst is None:
            unmapped += 1
            kind = kernel_kind(event)
            kinds[kind]["pattern_ms"] += us / steps / 1e3
        else:
            kind = module.kind(inst)
            inst_ms[(module.name, inst.name)] += us / steps / 1e3
        kinds[kind]["ms"] += us / steps / 1e3
    costs, shapes, uncounted = hlo_costs(list(modules.values()), inst_ms, top)
    for kind, row in kinds.items():
        row.update(costs[kind])
    seen = sorted({e.get("args", {}).get("hlo_module", "") for e in events} - {""})
    return {"steps": steps, "window_ms": window / steps / 1e3, "kinds": kinds,
            "events": len(events), "unmapped_events": unmapped, "modules": sorted(modules),
            "event_modules": seen, "lines": lines, "matmul_shapes": shapes,
            "uncounted_flops_calls": uncounted}


def _ceiling(kind: str, attr: dict, ceilings: dict) -> float | None:
    """A matmul kind's ceiling in TFLOP/s: its top shapes' measured rates, weighted by their
    FLOPs in the step (the time they would take at those rates); a memory kind's in GB/s."""
    if kind in MEMORY_KINDS:
        return ceilings.get("stream_gbs")
    rates = {json.dumps([m["shape"], m["dtypes"]]): m["tflops"] for m in ceilings.get("matmul", [])}
    found = [(s["flops"], rates[key]) for s in attr["matmul_shapes"].get(kind, [])
             if (key := json.dumps([s["shape"], s["dtypes"]])) in rates]
    flops = sum(f for f, _ in found)
    return flops / sum(f / rate for f, rate in found) if flops else None


def report(attr: dict, run: dict) -> dict:
    """The table's rows and summary from `attribute`'s result and the run's own figures
    (`run`: batch, steps, ceilings, ...)."""
    step_ms = attr["window_ms"]
    rows = []
    for kind, label in KINDS.items():
        k = attr["kinds"][kind]
        seconds = k["ms"] / 1e3
        row = {"kind": kind, "label": label, "ms": k["ms"], "share": k["ms"] / step_ms,
               "pattern_ms": k["pattern_ms"], "gflop": None, "tflops": None, "gb": None,
               "gbs": None, "ceiling": _ceiling(kind, attr, run.get("ceilings", {})),
               "of_ceiling": None}
        if kind != "gaps":
            row["gb"] = k["bytes"] / 1e9
            row["gbs"] = row["gb"] / seconds if seconds else None
        if kind in MATMUL_KINDS:
            row["gflop"] = k["flops"] / 1e9
            row["tflops"] = row["gflop"] / 1e3 / seconds if seconds else None
        achieved = row["tflops"] if kind in MATMUL_KINDS else row["gbs"]
        if achieved is not None and row["ceiling"]:
            row["of_ceiling"] = achieved / row["ceiling"]
        rows.append(row)
    flops = sum(k["flops"] for k in attr["kinds"].values())
    summary = {"step_ms": step_ms, "examples_per_sec": run["batch"] / step_ms * 1e3,
               "tflop_per_step": flops / 1e12, "achieved_tflops": flops / step_ms / 1e9,
               "events_per_step": attr["events"] / attr["steps"],
               "unmapped_events": attr["unmapped_events"],
               "unmapped_ms": sum(k["pattern_ms"] for k in attr["kinds"].values()),
               "uncounted_flops_calls": attr["uncounted_flops_calls"],
               "modules": attr["modules"], "event_modules": attr["event_modules"],
               "lines": attr["lines"], "matmul_shapes": attr["matmul_shapes"]}
    return {"run": run, "summary": summary, "rows": rows}


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(rep: dict) -> str:
    """The report as Markdown: what was run, the step's figures, then the table by kind."""
    run, s = rep["run"], rep["summary"]
    ceilings = run.get("ceilings", {})
    lines = [
        f"{run.get('device', '?')}, jax {run.get('jax', '?')}; {run.get('preset', '?')}, "
        f"batch {run['batch']}, {run.get('dtype', '?')}, {run.get('layout', '?')} "
        f"({run.get('packed_sizes') or 'caps'}); {run['steps']} traced steps after "
        f"{run.get('warmup', '?')} warm-up; XLA_FLAGS={run.get('xla_flags') or '(none)'}",
        "",
        f"- step (device window): {s['step_ms']:.2f} ms, {s['examples_per_sec']:,.1f} examples/s"
        + (f"; wall time per step while tracing {run['wall_ms']:.2f} ms" if "wall_ms" in run
           else ""),
        f"- FLOPs per step: {s['tflop_per_step']:.4g} TFLOP in the optimized HLO's dots and "
        f"convolutions ({s['achieved_tflops']:.3g} TFLOP/s)"
        + (f"; XLA's count of the lowered step: {run['lowered_tflop']:.4g} TFLOP"
           if run.get("lowered_tflop") is not None else "")
        + (f"; {s['uncounted_flops_calls']:g} dot or fused-attention calls per step not counted"
           if s["uncounted_flops_calls"] else ""),
        f"- device events: {s['events_per_step']:,.0f} per step on "
        f"{', '.join(s['lines']) or 'the host threads of XLA:CPU'}; not mapped to an HLO "
        f"instruction (kind from the kernel name): {s['unmapped_events']} of "
        f"{s['events_per_step'] * run['steps']:,.0f}, {s['unmapped_ms']:.3g} ms per step",
        "- ceilings: matmul " + (", ".join(
            f"{'x'.join(map(str, m['shape']))} {'/'.join(m['dtypes'])} {m['tflops']:.3g} TFLOP/s"
            for m in ceilings.get("matmul", [])) or "-")
        + (f"; y = x + 1 over {ceilings['stream_bytes'] / 2 / 2 ** 20:,.0f} MiB: "
           f"{ceilings['stream_gbs']:,.1f} GB/s (bytes read + written)"
           if "stream_gbs" in ceilings else ""),
        "",
        "| kind | ms/step | share | GFLOP/step | TFLOP/s | GB/step | GB/s | of ceiling "
        "| ms from kernel names |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        unit = "TFLOP/s" if r["kind"] in MATMUL_KINDS else "GB/s"
        ceiling = f"{r['of_ceiling']:.0%} of {_num(r['ceiling'])} {unit}" \
            if r["of_ceiling"] is not None else "-"
        lines.append(f"| {r['label']} | {r['ms']:.3f} | {r['share']:.1%} | {_num(r['gflop'])} "
                     f"| {_num(r['tflops'])} | {_num(r['gb'])} | {_num(r['gbs'])} | {ceiling} "
                     f"| {r['pattern_ms']:.3f} |")
    lines.append(f"| total | {s['step_ms']:.3f} | {sum(r['share'] for r in rep['rows']):.1%} "
                 "| | | | | | |")
    return "\n".join(lines)
