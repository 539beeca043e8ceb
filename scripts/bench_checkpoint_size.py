"""Diagnose at the sizes users run: a Llama-7B-shaped bf16 checkpoint (~13 GB, 291 tensors).

Builds a sparse ``.safetensors`` file (a valid header, then ``truncate``: zeros cost no disk),
plants a NaN (two bytes at one tensor's offset) and measures, in this one process:

* ``bare``: a bare loop over the file: ``safe_open`` + ``get_tensor`` + ``isfinite().all()`` +
  ``abs().amax()`` per tensor (what any checker must at least do);
* ``ampctl``: diagnose's state health (``readers.read`` + ``state_health``) on the same file;
* the ratio of their read throughputs (goal: ampctl >= 0.5x the bare loop), and against a
  faster bare loop (one ``aminmax`` per tensor, ``minmax``) for scale;

then runs ``ampctl diagnose --json`` on it in a subprocess and reads that process's peak RSS
(``VmHWM`` of the child; goal <= 2 GB) and whether the report names the planted tensor.
``--sharded`` does the same for a folder of shards with ``model.safetensors.index.json``.
The sparse files are deleted at the end.

    python scripts/bench_checkpoint_size.py                 # Llama-7B shape, ~13 GB
    python scripts/bench_checkpoint_size.py --layers 4      # ~2 GB, a quick look
    python scripts/bench_checkpoint_size.py --sharded       # also a 3-shard folder + index

Timings on a loaded machine are distorted: compare the ratio, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTER, VOCAB = 4096, 11008, 32000
NAN_BF16 = b"\xc0\x7f"  # 0x7FC0 little-endian: a bf16 quiet NaN


def llama_shapes(layers: int) -> list[tuple[str, list[int]]]:
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.{x}_proj.weight", [HIDDEN, HIDDEN]) for x in "qkvo"]
        out += [
            (f"{p}.mlp.gate_proj.weight", [INTER, HIDDEN]),
            (f"{p}.mlp.up_proj.weight", [INTER, HIDDEN]),
            (f"{p}.mlp.down_proj.weight", [HIDDEN, INTER]),
            (f"{p}.input_layernorm.weight", [HIDDEN]),
            (f"{p}.post_attention_layernorm.weight", [HIDDEN]),
        ]
    out += [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]
    return out


def write_sparse(path: Path, shapes: list[tuple[str, list[int]]], nan_in: str | None) -> int:
    """A valid bf16 safetensors file of zeros (sparse), a NaN planted in ``nan_in``; its size."""
    header, off = {}, 0
    for name, shape in shapes:
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    start = 8 + len(text)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text.encode())
        f.truncate(start + off)
        if nan_in is not None and nan_in in header:
            f.seek(start + header[nan_in]["data_offsets"][0] + 1000)
            f.write(NAN_BF16)
    return start + off


def bare_loop(paths: list[Path]) -> tuple[float, int]:
    import torch
    from safetensors import safe_open

    t0, n, bad = time.perf_counter(), 0, 0
    for p in paths:
        with safe_open(str(p), framework="pt", device="cpu") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is no dict
                t = f.get_tensor(k)
                bad += not bool(torch.isfinite(t).all())
                float(t.abs().amax())
                n += t.numel() * t.element_size()
                del t
    return time.perf_counter() - t0, bad


def minmax_loop(paths: list[Path]) -> float:
    """The fastest bare check we know: one ``aminmax`` per tensor (NaN and inf show in it)."""
    import torch
    from safetensors import safe_open

    t0 = time.perf_counter()
    for p in paths:
        with safe_open(str(p), framework="pt", device="cpu") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is no dict
                lo, hi = torch.aminmax(f.get_tensor(k))
                float(lo), float(hi)
    return time.perf_counter() - t0


def ampctl_health(target: Path) -> tuple[float, list[str]]:
    from ampctl.commands.diagnose import readers
    from ampctl.commands.diagnose.health import state_health

    t0 = time.perf_counter()
    st = state_health(readers.read(target))
    return time.perf_counter() - t0, [b.name for b in st.weights.bad]


def diagnose_child(target: Path) -> tuple[float, int, dict]:
    """``ampctl diagnose --json`` in a child process: (seconds, peak RSS bytes, report). The
    peak is the child's ``VmHWM`` (``ru_maxrss`` keeps the forking parent's peak across exec on
    Linux)."""
    code = (
        "import resource, sys\n"
        "from ampctl.cli import main\n"
        "sys.argv = ['ampctl', 'diagnose', sys.argv[1], '--json']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')]\n"
        "sys.stderr.write('RSS %s\\n' % hwm[0].split()[1])\n"
    )
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", code, str(target)], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    rss = [int(x.split()[1]) for x in r.stderr.splitlines() if x.startswith("RSS ")]
    if not rss:
        rss = [resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = {"error": r.stderr[-400:]}
    return wall, rss[-1] * 1024, doc


def named(doc: dict, tensor: str) -> bool:
    return any(tensor in (p.get("tensors") or []) for p in doc.get("problems", []))


def measure(label: str, target: Path, files: list[Path], size: int, planted: str) -> dict:
    gb = size / 1e9
    bare_s, bare_bad = bare_loop(files)
    minmax_s = minmax_loop(files)
    amp_s, amp_bad = ampctl_health(target)
    child_s, rss, doc = diagnose_child(target)
    row = {
        "case": label,
        "size_gb": round(gb, 2),
        "bare_s": round(bare_s, 2),
        "bare_gb_s": round(gb / bare_s, 2),
        "ampctl_s": round(amp_s, 2),
        "ampctl_gb_s": round(gb / amp_s, 2),
        "ratio": round(bare_s / amp_s, 2),
        "minmax_s": round(minmax_s, 2),
        "ratio_vs_minmax": round(minmax_s / amp_s, 2),
        "diagnose_s": round(child_s, 1),
        "peak_rss_gb": round(rss / 1e9, 2),
        "nan_named": named(doc, planted) and planted in amp_bad and bare_bad == 1,
    }
    print(json.dumps(row), flush=True)
    if "error" in doc:
        print(f"  diagnose failed: {doc['error']}", file=sys.stderr)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32: Llama-7B)")
    ap.add_argument("--sharded", action="store_true", help="also a folder of shards + index")
    ap.add_argument("--dir", default=None, help="where the sparse files go (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = llama_shapes(args.layers)
    planted = shapes[len(shapes) // 2][0]
    tmp = Path(tempfile.mkdtemp(prefix="ampctl-bench-ckpt-", dir=args.dir))
    rows = []
    try:
        one = tmp / "model.safetensors"
        size = write_sparse(one, shapes, planted)
        print(
            f"# {len(shapes)} bf16 tensors, {size / 1e9:.2f} GB (sparse), NaN planted in "
            f"{planted}; torch threads {torch.get_num_threads()}",
            flush=True,
        )
        rows.append(measure("one file", one, [one], size, planted))
        one.unlink()
        if args.sharded:
            folder = tmp / "sharded"
            folder.mkdir()
            k = 3
            parts = [shapes[i::k] for i in range(k)]
            wmap, total, files = {}, 0, []
            for i, part in enumerate(parts):
                name = f"model-{i + 1:05d}-of-{k:05d}.safetensors"
                total += write_sparse(folder / name, part, planted)
                files.append(folder / name)
                wmap.update({n: name for n, _ in part})
            index = {"metadata": {"total_size": total}, "weight_map": wmap}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
            rows.append(measure("3 shards + index.json", folder, files, total, planted))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = all(r["ratio"] >= 0.5 and r["peak_rss_gb"] <= 2.0 and r["nan_named"] for r in rows)
    print(f"# goals (ratio >= 0.5, peak RSS <= 2 GB, NaN named): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TERM", "dumb")
    sys.exit(main())
