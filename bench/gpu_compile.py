"""Kernel "pallas"'s step compiled by XLA for an NVIDIA GPU on a machine without one: whether
every family's step compiles (the pallas kernels through XLA's own Triton, not only PyPI's),
and how many kernels a step launches, the launch count a one-stream decode pays for
(issue 38; nothing runs, nothing is timed).

    python bench/gpu_compile.py [--shape NAME]... [--arch ARCH]... [--qtype Q4_0]...
                                [--rows 1,16] [--loop] [--gpu h200|h100] [--out DIR]

Needs JAX's CUDA plugin, best in an environment of its own (bench/README.md gives the
command: JAX's `jax[cuda13]` and kinetic's dependencies; this script puts the repository on
its path), and no GPU: JAX compiles ahead of time for a device it is described
(XLA's deviceless compilation, `jax.experimental.topologies.get_topology_desc` with a
target config, GPU_CONFIGS below: the H100 SXM's and H200's published figures; XLA's
fusion decisions read the compute capability and the core count from it). The step is traced as for a GPU
(kernels/target.py `for_gpu`) as the runner runs it (Runner.step_device, and with --loop
Runner.decode_steps' loop of EngineConfig.decode_steps steps), its arguments only shapes.

--shape: bench/gpu.py's random-weight models of real shapes (its SHAPES: smollm2-135m,
qwen25-0.5b, qwen25-1.5b, qwen3-1.7b, qwen3-30b-a3b-2l, qwen35-0.8b); --arch: tests/tiny_models.py's tiny model of a family (two layers); default
both lists: every family tiny plus qwen25-1.5b. For each model, qtype and row count the
table gives the compile's seconds and the launches of one step read from XLA's optimized
HLO: Triton kernels (the pallas calls), XLA's own kernels (fusions, copies and the rest),
and per layer (all of them over the model's layers, the embedding and head included); and,
from XLA's thunk sequence (dumped with the compile, after the thunk passes that make its
command buffers), the CUDA graphs a run replays, their nodes and the thunks run one by one
outside a graph (`graphs`). A loop's figures are one iteration's (its body and condition).
A compile that fails is a row with its error. The JSON (--out) keeps every row and the opcodes counted.

--sampler V (alone, or with models): the sampling chain for a vocabulary of V tokens
(151936: Qwen2.5's), as engine/sample_device.py's DeviceSampler compiles it: the CPU's form,
sampler.sample_rows at its 4-row bucket, and a GPU's, sampler.sample_batch at each --rows;
per compile its seconds, XLA's temporaries (memory_analysis), its kernels, conditionals and
loops, and its CUDA graphs as above.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver, no CUPTI here
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

_COMMON = """
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
"""
GPU_CONFIGS = {
    "h100": ("memory_bandwidth: 3352320000000\n  device_memory_size: 84929347584",
             "NVIDIA H100 80GB HBM3"),
    "h200": ("memory_bandwidth: 4800000000000\n  device_memory_size: 150754820096",
             "NVIDIA H200"),
}
ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "mistral3", "lfm2", "qwen3moe", "lfm2moe",
         "qwen35", "qwen35moe")
# opcodes that launch nothing (layout, tuples, parameters) and those whose kernels are in
# the computations they call
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "opt-barrier", "add-dependency", "partition-id", "replica-id"}
CALLS = {"while", "call", "conditional"}
TRITON = "__gpu$xla.gpu.triton"


def target_config(gpu: str) -> str:
    memory, name = GPU_CONFIGS[gpu]
    return (f"gpu_device_info {{{_COMMON}  {memory}\n}}\nplatform_name: \"CUDA\"\n"
            f"dnn_version_info {{ major: 9 minor: 12 }}\n"
            f"runtime_version {{ major: 13 minor: 0 patch: 0 }}\n"
            f"device_description_str: \"{name}\"\n")


def computations(hlo: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text ("ENTRY" for the
    entry computation)."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = "ENTRY" if head.group(1) else head.group(2)
            out[name] = []
        elif name and line.startswith("  "):
            out[name].append(line)
    return out


def launches(hlo: str) -> dict:
    """Kernels one run of the entry computation launches: {"triton", "xla", "opcodes"
    (Counter of the launching opcodes), "loops", "conditionals"}. A while loop counts one
    iteration (its condition and body), a conditional its largest branch."""
    comps = computations(hlo)
    seen = Counter()
    shape = {"loops": 0, "conditionals": 0}

    def walk(name: str, scale: int = 1) -> Counter:
        count = Counter()
        for line in comps.get(name, []):
            op = re.match(r"\s+(?:ROOT )?%\S+ = .*? ([a-z][\w\-]*)\((.*)$", line)
            if not op:
                continue
            opcode = op.group(1)
            if opcode in FREE:
                continue
            if opcode in CALLS:
                names = re.findall(r"(?:body|condition|to_apply|calls)=%([\w.\-]+)", line)
                for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                    names += [n.strip().lstrip("%") for n in group.split(",")]
                if opcode == "while":
                    shape["loops"] += 1
                    for n in names:
                        count += walk(n)
                elif opcode == "conditional":
                    shape["conditionals"] += 1
                    branches = [walk(n) for n in names]
                    count += max(branches, key=lambda c: sum(c.values()), default=Counter())
                else:
                    for n in names:
                        count += walk(n)
                continue
            key = "triton" if TRITON in line else opcode
            count[key] += 1
        return count

    count = walk("ENTRY")
    seen.update(count)
    triton = seen.pop("triton", 0)
    return {"triton": triton, "xla": sum(seen.values()), "opcodes": dict(seen), **shape}


def write_model(folder: str, name: str, qtype: str) -> tuple[str, int]:
    """(path, layers) of a random-weight GGUF: bench/gpu.py's shape `name` or the tiny
    model of family `name`."""
    from bench.gpu import SHAPES, write_shape
    from tests.tiny_models import write_tiny_model
    path = os.path.join(folder, f"{name}-{qtype}.gguf")
    if name in SHAPES:
        return path, write_shape(path, SHAPES[name], qtype)
    write_tiny_model(path, name, qtype=qtype, context_length=256)
    return path, 2


class _Compiled(Exception):
    pass


def graphs(thunks: str, known_trips: bool = True) -> dict:
    """What one run of an executable's thunk sequence (XLA's dump of it after its thunk
    passes, `*.thunk_sequence_after_thunk_passes.txt`) replays as CUDA graphs: {"graphs"
    (command buffers), "nodes" (the thunks inside them), "outside" (Counter of the thunks
    run one by one, each its own launch or copy), "whiles"}. A while loop counts one
    iteration, as `launches` does: its body, and its condition unless `known_trips` (XLA
    runs a loop of a known trip count, as the HLO's while says, without its condition: no
    predicate read back to the host)."""
    count = {"graphs": 0, "nodes": 0, "outside": Counter(), "whiles": 0}
    stack = []                  # (indent, kind) of the thunks enclosing this line's
    in_condition = False
    for line in thunks.splitlines():
        if line.strip() in ("condition:", "body:"):
            in_condition = line.strip() == "condition:"
            continue
        m = re.match(r"( *)\d+: (k\w+)", line)
        if not m:
            continue
        depth, kind = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        kinds = [k for _, k in stack]
        stack.append((depth, kind))
        if not kinds:
            in_condition = False
        if in_condition and known_trips:
            continue
        if "kCommandBuffer" in kinds:
            count["nodes"] += kinds[-1] == "kCommandBuffer"   # not a node's own parts
        elif kind == "kCommandBuffer":
            count["graphs"] += 1
        elif kind == "kWhile":
            count["whiles"] += 1
        elif kind != "kSequential" and all(k in ("kWhile", "kSequential") for k in kinds):
            count["outside"][kind] += 1     # a thunk's own parts (a dynamic-slice
                                            # fusion's copy) are not counted again
    return count


def abstract(tree, sharding):
    """tree with each array an abstract one of its shape and type on `sharding`'s device."""
    import jax
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                        if isinstance(a, (jax.Array, np.ndarray)) else a, tree)


def graph_columns(hlo: str, thunks: str) -> tuple[dict, str]:
    """An executable's CUDA graphs (`graphs`, loops counted as the HLO says their trip
    counts are known or not) as a JSON row's fields, and its thunks outside a graph as the
    table's text."""
    cuda = graphs(thunks, all('"known_trip_count"' in line
                              for line in hlo.splitlines() if " while(" in line))
    alone = ", ".join(f"{n} {k[1:]}" for k, n in sorted(cuda["outside"].items())) or "none"
    return {"graphs": cuda["graphs"], "graph_nodes": cuda["nodes"],
            "outside": dict(cuda["outside"])}, alone


def compile_dumped(compile_) -> tuple[float, object, str]:
    """(seconds, the compiled executable, its thunk sequence): compile_(options) run with XLA
    dumping the thunk sequence after its thunk passes (which make the command buffers), or
    as emitted where no pass changed it."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        compiled = compile_({"xla_dump_to": dump, "xla_dump_hlo_pass_re": "NONE"})
        seconds = time.perf_counter() - start
        files = sorted(os.listdir(dump))
        name = next((f for f in files if f.endswith(".thunk_sequence_after_thunk_passes.txt")),
                    next(f for f in files if f.endswith(".thunk_sequence.txt")))
        return seconds, compiled, open(os.path.join(dump, name)).read()


def sampler_table(vocab: int, rows_list: list[int], sharding) -> list[dict]:
    """The sampling chain's compiles (module docstring, --sampler), printed as a table."""
    from kinetic.engine import sampler
    from kinetic.engine.sample_batch import SampleShape
    from kinetic.engine.sample_device import DeviceSampler
    from kinetic.kernels import target
    shape = SampleShape.of(vocab, 4096, sorted({1, *rows_list}), [0])
    chains = DeviceSampler(vocab, exact=False)
    print(f"\n| chain, {vocab} tokens | rows | compile s | temporaries MiB | XLA kernels "
          "| conditionals | loops | CUDA graphs of nodes | thunks outside a graph |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = []
    for name, B in [("sample_rows", shape.chain_bucket)] + [
            ("sample_batch", B) for B in rows_list]:
        fn = getattr(sampler, name)
        args = abstract(chains._warm_chain(shape, B), sharding)
        with target.for_gpu():
            seconds, compiled, thunks = compile_dumped(lambda options: fn.trace(
                *args, max_candidates=shape.max_candidates).lower().compile(options))
        hlo = compiled.as_text()
        count = launches(hlo)
        cuda, alone = graph_columns(hlo, thunks)
        row = {"chain": name, "rows": B, "seconds": seconds,
               "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, **count, **cuda}
        print(f"| {name} | {B} | {seconds:.1f} | {row['temp_bytes'] / 2**20:.0f} "
              f"| {count['xla']} | {count['conditionals']} | {count['loops']} "
              f"| {cuda['graphs']} of {cuda['graph_nodes']} | {alone} |", flush=True)
        out.append(row)
    return out


def compile_step(path: str, rows: int, loop: bool, sharding) -> tuple[float, str, str]:
    """(seconds, optimized HLO text, thunk sequence) of the runner's step (or decode loop)
    at `rows` rows, compiled for the GPU that `sharding`'s device is."""
    from kinetic.engine.runner import Runner, RunnerConfig
    from kinetic.kernels import target
    from kinetic.model.loader import load_model
    from kinetic.engine.engine_config import EngineConfig
    pages = 4
    runner = Runner(load_model(path, kernel="pallas"),
                    RunnerConfig(step_tokens=rows, num_slots=rows, page_size=16,
                                 num_pages=rows * pages + 1, pages_per_slot=pages,
                                 decode_steps=EngineConfig().decode_steps))
    statics = (5, 6) if loop else (4, 5)
    out = {}

    def compile_(*args):
        args = [a if i in statics else abstract(a, sharding) for i, a in enumerate(args)]
        with target.for_gpu():
            out["seconds"], compiled, out["thunks"] = compile_dumped(
                lambda options: jitted.trace(*args).lower().compile(options))
            out["hlo"] = compiled.as_text()
        raise _Compiled

    slots = np.arange(rows)
    table = np.ones((rows, pages), np.int32)
    try:
        if loop:
            jitted, runner._decode = runner._decode, compile_
            n = runner.config.decode_steps
            runner.decode_steps(slots, np.zeros((n, rows), int) + np.arange(n)[:, None], slots,
                                16 + slots + np.arange(n)[:, None], table,
                                (None,) * rows)
        else:
            jitted, runner._step = runner._step, compile_
            runner.step_device(slots, np.zeros(rows, int), slots, 16 + slots, table)
    except _Compiled:
        pass
    return out["seconds"], out["hlo"], out["thunks"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", help="bench/gpu.py's real shapes")
    p.add_argument("--arch", action="append", help="a family's tiny model")
    p.add_argument("--qtype", action="append")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--loop", action="store_true",
                   help="also the server's decode loop (Runner.decode_steps)")
    p.add_argument("--gpu", default="h200", choices=sorted(GPU_CONFIGS))
    p.add_argument("--sampler", type=int, metavar="V",
                   help="the sampling chain for V tokens (alone unless models are named)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not args.shape and not args.arch and not args.sampler:
        args.shape, args.arch = ["qwen25-1.5b"], list(ARCHS)
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=target_config(args.gpu))
    sharding = NamedSharding(topologies.make_mesh(topology, (1,), ("d",)), PartitionSpec())
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"# jax {jax.__version__}, compiled for {GPU_CONFIGS[args.gpu][1]} (deviceless)")
    if args.shape or args.arch:
        print("| model | qtype | rows | what | compile s | Triton | XLA | a layer | loops "
              "| CUDA graphs of nodes | thunks outside a graph |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name in (args.shape or []) + (args.arch or []):
            for qtype in args.qtype or ["Q4_0"]:
                try:
                    path, layers = write_model(folder, name, qtype)
                except Exception as e:   # a family/format the writer has no tiny model of
                    results.append({"model": name, "qtype": qtype, "error": repr(e)})
                    print(f"| {name} | {qtype} | | | not written: {e} | | | | | | |")
                    continue
                for rows in rows_list:
                    for loop in (False, True) if args.loop else (False,):
                        what = "decode loop" if loop else "step"
                        row = {"model": name, "qtype": qtype, "rows": rows, "what": what,
                               "layers": layers}
                        try:
                            row["seconds"], hlo, thunks = compile_step(path, rows, loop,
                                                                       sharding)
                            if os.environ.get("KINETIC_DUMP_HLO"):
                                open(os.environ["KINETIC_DUMP_HLO"], "w").write(hlo)
                        except Exception as e:
                            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                            print(f"| {name} | {qtype} | {rows} | {what} | FAILED: "
                                  f"{row['error'][:200]} | | | | | | |", flush=True)
                            results.append(row)
                            continue
                        row.update(launches(hlo))
                        cuda, alone = graph_columns(hlo, thunks)
                        row.update(cuda)
                        per_layer = (row["triton"] + row["xla"]) / layers
                        print(f"| {name} | {qtype} | {rows} | {what} | {row['seconds']:.1f} "
                              f"| {row['triton']} | {row['xla']} | {per_layer:.1f} "
                              f"| {row['loops']} | {cuda['graphs']} of {cuda['graph_nodes']} "
                              f"| {alone} |", flush=True)
                        results.append(row)
    if args.sampler:
        results += sampler_table(args.sampler, rows_list, sharding)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_compile.json"), "w") as f:
            json.dump({"gpu": args.gpu, "jax": jax.__version__, "rows": results}, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
