"""specmesh's C kernels for the CPU (`csrc/`), where a decode step's time went outside what the machine allows:

* **Block-table attention** (`block_attention`, `csrc/block_attention_cpu.c`): the short sequences of a forward
  (decode steps, verify blocks) attend over their KV where the block pool holds it, in one call per layer for
  the whole batch. `PagedRunner`'s default on a CPU in float32 (`--attention-backend auto`). SDPA is one call
  per sequence and layer, and for the few queries of a decode step or a verify block each call is mostly fixed
  cost (dispatch, the flash kernel's set-up and threads): on the demo target a 16 x 5 verify batch spent 12-14
  ms of its 55 in 160 such calls, and a session on a shared prefix paid one call per run of blocks plus a
  merge. Here the whole batch is one call per layer, the block table is read where the pool holds it (no
  gather, no merge), and the keys and values are read once per KV head.
  `block_attention_rope` does the same from the layer's projection output, with rotary and the new keys' and
  values' writes into the pool in the same call: a batch of decode and verify blocks only (no prefill chunk).
* **One row through a linear layer** (`gemv`, `csrc/gemv_cpu.c`): a decode step's matmuls are matrix-vector
  products, which MKL runs on one thread at ~16 GB/s; this one splits the weights' rows over both threads
  (~34-40 GB/s on the demo target's matrices), with a fixed split so every call rounds the same way.
* **A whole forward of one sequence's few tokens** (`DecodeStep`, `csrc/decode_step_cpu.c`): a decode step, a
  verify block at one stream or a short chunk (up to `STEP_MAX_TOKENS`), token ids to logits in one call, one
  OpenMP region with the same GEMV inside (a block's rows read the weights once); the operators and thread
  joins around the matmuls were ~2.5 ms of a ~8 ms step.

All run on torch's own OpenMP team: the library links the libgomp torch has loaded, so the threads still
spinning after the last operator take the work instead of new threads fighting them for the cores.

The library is compiled on first use with the machine's C compiler (`cc`, or `$CC`; well under a second) for
this CPU (`-march=native`; `SPECMESH_CPU_MARCH` names another target, e.g. `x86-64-v3` for AVX2 and FMA or
`x86-64-v2` for neither, which the tests use to run every vector width's code on whichever host runs them), and
cached under `$SPECMESH_CACHE_DIR` (default `~/.cache/specmesh`) by a hash of
the sources, the flags and the CPU's feature flags. Without a compiler, or with `SPECMESH_CPU_KERNELS=0` (for
diagnosis and A/B runs), `load()` says why once and returns None; the runners then use torch's kernels,
which are slower, not different. `SPECMESH_CPU_PANELS=0` keeps the fused step on the [in, out] rows where the
build could pack panels (what a CPU without AVX-512 or AVX2 runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / n
    for n in ("block_attention_cpu.c", "gemv_cpu.c", "decode_step_cpu.c", "elementwise_cpu.c")
)
# built a second time over bfloat16 KV pools (SPECMESH_KV_BF16: `--kv-cache-dtype bfloat16`, attend_rows.h)
KV_SOURCES = tuple(Path(__file__).with_name("csrc") / n for n in ("block_attention_cpu.c", "decode_step_cpu.c"))
# The pools' dtypes the kernels read and write, and the suffix of the entries built for each
KV_DTYPES = {torch.float32: "", torch.bfloat16: "_bf16"}
# The fused step built once more over float pools with its panels in bfloat16 (SPECMESH_PANELS_BF16), the entries'
# names ending in this
PANELS_BF16 = "_wbf16"
# included by the sources: part of the cache key
HEADERS = tuple(Path(__file__).with_name("csrc") / n for n in ("attend_rows.h", "rms_row.h"))
# -ffast-math on the compile step only: it lets gcc call glibc's vectorised expf (the kernel never makes an
# infinity: masked keys are skipped). Linked without it, so no crtfastmath.o turns on flush-to-zero for the
# whole process on load.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-D_GNU_SOURCE")
LINK_FLAGS = ("-shared", "-fopenmp")
MAX_TOKENS = 16  # a sequence with more new tokens (a prefill chunk) attends by SDPA's flash kernel
# A forward of up to this many tokens of one sequence goes through the fused step (`DecodeStep`; of several
# sequences, up to STEP_MAX_BATCH_TOKENS_PANELS in all where the weights are in panels, else this many).
# With the weights in panels (a build with AVX-512, or AVX2 and FMA) its products run as fast as oneDNN's packed
# GEMM from one row to ~80, and without the ragged forward's few hundred operators: on the demo target,
# interleaved, 4 x 5 rows 11.9 ms against 14.6, 8 x 5 20.3 / 22.0, 16 x 5 41.2 / 41.3 (the demo draft 16 x 5 4.8
# / 5.2).
# Without panels each row past the first adds ~0.4 ms on the demo target, and from ~9 rows oneDNN is as fast;
# a model whose weights take at most STEP_SMALL_BYTES (the demo draft's 14 MB stay in the L3) computes a row in
# a tenth of that, against the ragged forward's fixed cost: up to STEP_MAX_TOKENS_SMALL.
STEP_MAX_TOKENS_PANELS = 80
# With panels a batch of several sequences' blocks goes through the step up to this many tokens in all (each
# sequence up to STEP_MAX_TOKENS_PANELS). Measured on a host whose cores have two 512-bit FMA units (where the
# panels' products keep the GEMM's rate past 80 rows; a host with one was not measured at these shapes), the
# step beat the ragged forward at every batch of verify blocks (demo target, interleaved, ms: 12 x 8 at 560
# cached tokens 48.0 against 53.4, 16 x 9 66.1 / 69.5, 16 x 6 at 128 28.6 / 34.1, 32 x 5 at 300 66.8 / 70.7,
# 32 x 9 117.5 / 141.5, 24 x 17 at 200 150.8 / 153.8).
STEP_MAX_BATCH_TOKENS_PANELS = 256
STEP_MAX_TOKENS = 8
STEP_MAX_TOKENS_SMALL = 16
STEP_SMALL_BYTES = 32 * 2**20
GEMV_PARALLEL_MIN = 64 * 1024  # weights below this many elements: one thread
# Below this much work (rows x keys over the batch) one thread: starting a second costs more than it saves.
PARALLEL_MIN_WORK = 4096

_lock = threading.Lock()
_KV_ENTRIES: dict = {}  # filled by load()
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    env = os.environ.get("SPECMESH_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specmesh"


def march() -> str:
    """The CPU the kernels are built for: `native` (this one) unless `SPECMESH_CPU_MARCH` names another."""
    return os.environ.get("SPECMESH_CPU_MARCH") or "native"


def _flags() -> tuple[str, ...]:
    return (*COMPILE_FLAGS, f"-march={march()}")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str, out: Path) -> None:
    """Compile and link the library to `out` atomically (concurrent processes each write their own file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        flags = _flags()
        cmds = [[cc, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs, strict=True)]
        for src in KV_SOURCES:
            objs.append(Path(tmp) / f"{src.stem}_bf16.o")
            cmds.append([cc, *flags, "-DSPECMESH_KV_BF16", "-c", str(src), "-o", str(objs[-1])])
        step = Path(__file__).with_name("csrc") / "decode_step_cpu.c"
        objs.append(Path(tmp) / f"{step.stem}{PANELS_BF16}.o")
        cmds.append([cc, *flags, "-DSPECMESH_PANELS_BF16", "-c", str(step), "-o", str(objs[-1])])
        lib = Path(tmp) / "k.so"
        cmds.append([cc, *LINK_FLAGS, *map(str, objs), "-o", str(lib), "-lm"])
        for cmd in cmds:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
        os.replace(lib, out)


def load() -> ctypes.CDLL | None:
    """The compiled kernels (built and cached on first use), or None where they cannot be built here or are
    turned off."""
    global _lib, _tried
    if _tried:  # every forward asks, per layer and per matmul: no lock once settled
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("SPECMESH_CPU_KERNELS", "1") == "0":
            log.info("SPECMESH_CPU_KERNELS=0: specmesh's CPU kernels are off, torch's serve instead")
            return None
        cc = shutil.which(os.environ.get("CC", "cc"))
        if cc is None:
            log.warning("no C compiler (cc) here: specmesh's CPU kernels are off, torch's serve instead")
            return None
        parts = [src.read_bytes() for src in (*SOURCES, *HEADERS)]
        parts += [" ".join(_flags() + LINK_FLAGS + (*KV_DTYPES.values(), PANELS_BF16)).encode(), cc.encode()]
        parts.append(_cpu_flags().encode())
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
        path = cache_dir() / f"cpu_kernels-{platform.machine()}-{key}.so"
        try:
            if not path.exists():
                _build(cc, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("specmesh's CPU kernels could not be built (%s): torch's serve instead", e)
            return None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        f32, i32 = ctypes.c_float, ctypes.c_int
        attention = [p, p, p, p, p, p, i64, i64, i64, i64, i64, p, f32, p, p, i32]
        by_kv = {
            "specmesh_block_attention": attention,
            "specmesh_block_attention_rope": [*attention, p, p],
            "specmesh_decode_step": [p, p, p, p, p, p, p, p, p, p, f32, p, p, p, p, i32, p],
        }
        _KV_ENTRIES.clear()  # (name, pools' dtype) -> the entry built for it, looked up once per call
        for name, argtypes in by_kv.items():
            for dtype, suffix in KV_DTYPES.items():
                fn = getattr(lib, name + suffix)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                _KV_ENTRIES[name, dtype] = fn
        fn = getattr(lib, "specmesh_decode_step" + PANELS_BF16)
        fn.argtypes, fn.restype = by_kv["specmesh_decode_step"], ctypes.c_int
        _KV_ENTRIES["specmesh_decode_step" + PANELS_BF16, torch.float32] = fn
        for name in ("specmesh_decode_step_panel", "specmesh_decode_step_panel" + PANELS_BF16):
            getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int
        fn = lib.specmesh_gemv
        fn.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        lib.specmesh_decode_step_phases.argtypes, lib.specmesh_decode_step_phases.restype = [], ctypes.c_int
        fn = lib.specmesh_rms_norm
        fn.argtypes = [p, p, p, ctypes.c_float, i64, i64, i64, ctypes.c_int]
        fn.restype = None
        fn = lib.specmesh_silu_mul
        fn.argtypes = [p, p, i64, i64, i64, ctypes.c_int]
        fn.restype = None
        _lib = lib
        return lib


def gemv_fits(w: torch.Tensor) -> bool:
    """Whether `gemv` takes this weight: float32 on the CPU, an [out, in] view of [in, out] rows (how the
    decoders store their weights for MKL)."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and w.stride(0) == 1


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, b) for one row x [1, in] (float32, CPU) and a weight `gemv_fits` takes."""
    lib = load()
    if lib is None:
        raise RuntimeError("specmesh's CPU kernels are not built here")
    out, n_in = w.shape
    if not gemv_fits(w) or x.shape != (1, n_in) or x.dtype != torch.float32:
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} against w {tuple(w.shape)} strides {w.stride()}")
    if b is not None and (b.shape != (out,) or b.dtype != torch.float32):
        raise ValueError(f"gemv: bias {tuple(b.shape)} for {out} outputs")
    x = x.contiguous()
    b = b.contiguous() if b is not None else None
    y = torch.empty((1, out), dtype=torch.float32)
    threads = torch.get_num_threads() if out * n_in >= GEMV_PARALLEL_MIN else 1
    with _profiled("specmesh::cpu_gemv"):
        rc = lib.specmesh_gemv(
            y.data_ptr(),
            x.data_ptr(),
            w.data_ptr(),
            b.data_ptr() if b is not None else None,
            n_in,
            out,
            w.stride(1),
            threads,
        )
    if rc:
        raise MemoryError("specmesh's CPU gemv could not allocate its partial sums")
    return y


# Elements of a batch below which the elementwise kernels run on one thread (waking the team costs more).
ELEMENTWISE_PARALLEL_MIN = 1 << 14


def _rows_fit(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def _team(elements: int) -> int:
    return torch.get_num_threads() if elements >= ELEMENTWISE_PARALLEL_MIN else 1


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """F.rms_norm(x, w.shape, w, eps) for rows x [n, H] (float32, CPU, each row contiguous) in one call, or
    None where the kernel does not take these tensors (the caller uses torch's)."""
    lib = load()
    if lib is None or not _rows_fit(x) or w.shape != (x.shape[1],) or w.dtype != torch.float32:
        return None
    n, h = x.shape
    w = w.contiguous()
    y = torch.empty((n, h), dtype=torch.float32)
    with _profiled("specmesh::cpu_rms_norm"):
        lib.specmesh_rms_norm(y.data_ptr(), x.data_ptr(), w.data_ptr(), float(eps), n, h, x.stride(0), _team(n * h))
    return y


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor | None:
    """silu(gu[:, :inter]) * gu[:, inter:] for rows gu [n, 2 inter] (float32, CPU, each row contiguous) in one
    call, or None where the kernel does not take it."""
    lib = load()
    if lib is None or not _rows_fit(gu) or gu.shape[1] != 2 * inter:
        return None
    n = gu.shape[0]
    y = torch.empty((n, inter), dtype=torch.float32)
    with _profiled("specmesh::cpu_silu_mul"):
        lib.specmesh_silu_mul(y.data_ptr(), gu.data_ptr(), n, inter, gu.stride(0), _team(n * inter))
    return y


class Plan:
    """One forward's call, built once for every layer: the sequences' (first batch row, new tokens, first
    position), their block tables, and the (sequence, KV head) units split over `threads` by work."""

    __slots__ = ("bounds", "end", "n_kv", "segs", "strides", "tables", "threads", "units", "width")

    def __init__(self, spans: Sequence[tuple[int, int, int]], tables: Sequence[Sequence[int]], n_kv: int, group: int):
        if not spans or len(spans) != len(tables) or any(n < 1 for _, n, _ in spans):
            raise ValueError("a CPU attention plan needs one table per sequence and new tokens in each")
        self.n_kv = n_kv
        self.strides: tuple[tuple[int, ...], torch.Tensor] | None = None  # the tensors' strides, once called
        self.width = max(1, max(len(t) for t in tables))
        rows = torch.zeros((len(tables), self.width), dtype=torch.int32)
        for i, t in enumerate(tables):
            if t:
                rows[i, : len(t)] = torch.tensor(list(t), dtype=torch.int32)
        self.tables = rows
        self.segs = torch.tensor(list(spans), dtype=torch.int64).view(-1, 3)
        self.end = max(start + n for _, n, start in spans)  # one past the last position attended
        # Each unit's work is its rows x the keys they attend; cut the units into equal-work shares.
        work = [n * group * (start + n) for _, n, start in spans for _ in range(n_kv)]
        total = sum(work)
        self.threads = 1 if total < PARALLEL_MIN_WORK else max(1, min(torch.get_num_threads(), len(work)))
        self.units = torch.arange(len(work), dtype=torch.int64)
        bounds, acc, share = [0], 0, 1
        for u, w in enumerate(work):
            acc += w
            while share < self.threads and acc * self.threads >= total * share:
                bounds.append(u + 1)
                share += 1
        while len(bounds) < self.threads:
            bounds.append(len(work))
        bounds.append(len(work))
        self.bounds = torch.tensor(bounds, dtype=torch.int64)


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel takes these queries: float32 on the CPU."""
    return q.device.type == "cpu" and q.dtype == torch.float32


def block_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: Plan,
    block_size: int,
    scale: float,
) -> None:
    """out[rows of the plan's sequences] = attention of q ([T, nh, D]) over each sequence's keys and values
    in the pool (k_pool, v_pool: [n_kv, slots, D], float32 or bfloat16) up to its own position. Rows of other
    sequences are left as they are."""
    lib = load()
    if lib is None:
        raise RuntimeError("specmesh's CPU kernels are not built here")
    _, nh, d = q.shape
    n_kv = k_pool.shape[0]
    fn = _kv_entry("specmesh_block_attention", k_pool, v_pool)
    if not (supports(q) and out.dtype == torch.float32 and fn is not None):
        raise ValueError("the CPU block-table attention kernel takes float32 CPU tensors (float32 or bfloat16 pools)")
    if nh % n_kv or n_kv != plan.n_kv or out.shape != q.shape or k_pool.shape != v_pool.shape or k_pool.shape[2] != d:
        raise ValueError(f"CPU block attention: q {tuple(q.shape)} against a pool {tuple(k_pool.shape)}")
    _call(fn, out, q, k_pool, v_pool, plan, block_size, scale)


def _kv_entry(name: str, k_pool: torch.Tensor, v_pool: torch.Tensor):
    """The kernel entry `name` built for these pools' dtype (`KV_DTYPES`), None for pools it does not take."""
    if k_pool.device.type != "cpu" or k_pool.dtype != v_pool.dtype:
        return None
    return _KV_ENTRIES.get((name, k_pool.dtype))


def block_attention_rope(
    out: torch.Tensor,
    qkv: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: Plan,
    block_size: int,
    scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """`block_attention` from a projection's output: qkv [T, nh + 2 n_kv, D] holds the plan's rows' queries,
    keys and values before rotary. Rotary (cos, sin: [positions, 1, D] tables, rotate_half's sign folded into
    sin, as the decoders keep them) is applied on the way in, each new key and value is written into its slot
    of the pools, and the rows attend as `block_attention`'s: a decode or verify batch's rotary, KV write and
    attention in one call per layer instead of eight operators."""
    lib = load()
    if lib is None:
        raise RuntimeError("specmesh's CPU kernels are not built here")
    n_kv, d = k_pool.shape[0], k_pool.shape[2]
    nh = out.shape[1]
    fn = _kv_entry("specmesh_block_attention_rope", k_pool, v_pool)
    if not (supports(qkv) and out.dtype == cos.dtype == sin.dtype == torch.float32 and fn is not None):
        raise ValueError("the CPU block-table attention kernel takes float32 CPU tensors (float32 or bfloat16 pools)")
    if qkv.shape != (out.shape[0], nh + 2 * n_kv, d) or out.shape[2] != d or k_pool.shape != v_pool.shape:
        raise ValueError(f"CPU block attention: qkv {tuple(qkv.shape)} against a pool {tuple(k_pool.shape)}")
    if nh % n_kv or n_kv != plan.n_kv or d % 2 or d > 512:
        raise ValueError(f"CPU block attention: {nh} query heads over {n_kv} KV heads of {d}")
    if (
        cos.shape != sin.shape
        or cos.shape[0] < plan.end
        or cos.shape[-1] != d
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        raise ValueError(f"CPU block attention: rotary tables {tuple(cos.shape)} for {plan.end} positions of {d}")
    _call(fn, out, qkv, k_pool, v_pool, plan, block_size, scale, cos, sin)


def _profiled(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named for the kernel while torch's profiler runs (its breakdowns would otherwise
    count the call as the gap between operators); nothing otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _call(fn, out, q, k_pool, v_pool, plan: Plan, block_size: int, scale: float, *rotary: torch.Tensor) -> None:
    """One of the kernel's entries over the plan: q is the queries or (with `rotary`, its cos and sin tables)
    the projection's output; the tensors' strides go with the plan, built once for every layer of a forward."""
    if q.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("CPU block attention needs the head dimension contiguous")
    key = tuple(t.stride(i) for t in (out, q, k_pool, v_pool) for i in (0, 1))
    if plan.strides is None or plan.strides[0] != key:  # every layer of a forward has the same layout
        plan.strides = (key, torch.tensor(key, dtype=torch.int64))
    n_kv, nh, d = k_pool.shape[0], out.shape[1], out.shape[2]
    with _profiled("specmesh::cpu_block_attention"):
        rc = fn(
            out.data_ptr(),
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            plan.tables.data_ptr(),
            plan.segs.data_ptr(),
            plan.width,
            n_kv,
            nh // n_kv,
            d,
            block_size,
            plan.strides[1].data_ptr(),
            float(scale),
            plan.units.data_ptr(),
            plan.bounds.data_ptr(),
            plan.threads,
            *(t.data_ptr() for t in rotary),
        )
    if rc:
        raise MemoryError("the CPU block-table attention kernel could not allocate its scratch")


# decode_step_cpu.c's layout of its arguments: per layer these pointers and floats, then the dimensions.
_LN1, _WQKV, _BQKV, _WO, _BO, _QN, _KN, _LN2, _WGU, _BGU, _WD, _BD, _KPOOL, _VPOOL, _NPTR = range(15)
_NFL = 5
_BS, _NSEQ, _K_SH, _K_SS, _V_SH, _V_SS, _NTOK, _NLOG, _TW, _PANELW, _NDIM = range(7, 18)


def _rows_of(w: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The [out, in] view of [in, out] rows a decoder keeps (the first of a packed pair)."""
    return w[0] if isinstance(w, tuple) else w


def panels(w: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The [in, out] rows of `w` (an [out, in] view, `_rows_of`) as [ceil(out / width), in, width] panels, the
    last one's missing columns zero: the fused step's layout where its build packs (decode_step_cpu.c). Into
    `out` (contiguous, that shape) where given."""
    rows = w.t()
    pad = -rows.shape[1] % width
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    packed = rows.reshape(rows.shape[0], -1, width).permute(1, 0, 2)
    return packed.contiguous() if out is None else out.copy_(packed)


HUGE_PAGE = 2 * 2**20


def huge_page_floats(n: int) -> torch.Tensor:
    """n float32 elements of fresh memory starting on a 2 MiB boundary, asked of the kernel in transparent huge
    pages where it offers them (`madvise`; Linux's default THP mode gives them only to regions that ask).
    Streamed weights read faster from huge pages: a 4 KiB page is 160 ns of one core's stream here, and each
    new one costs a TLB miss; the demo target's one-token step took 5 % less (a 512 MiB sum reads 10-35 %
    faster). Elsewhere, ordinary pages."""
    region = mmap.mmap(-1, n * 4 + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel built without THP refuses the advice
            region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping as long as any view of it lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + n * 4].view(torch.float32)


def pack_panels(ws: Sequence[torch.Tensor], width: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """`panels` of each [out, in] view in `ws`, one after another (64-byte aligned) in one huge-page region, in
    `dtype` (float32, or bfloat16 rounded to nearest even as torch's conversion rounds)."""
    per = 4 // dtype.itemsize  # elements of `dtype` in one float of the region
    shapes = [(-(-w.shape[0] // width), w.shape[1], width) for w in ws]
    sizes = [-(-(a * b * c) // (16 * per)) * 16 * per for a, b, c in shapes]
    arena = huge_page_floats(sum(sizes) // per).view(dtype)
    out, at = [], 0
    for w, shape, size in zip(ws, shapes, sizes, strict=True):
        out.append(panels(w, width, arena[at : at + shape[0] * shape[1] * shape[2]].view(shape)))
        at += size
    return out


def _dense(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())


# The fused step's phases, in decode_step_cpu.c's order (its NPHASE).
STEP_PHASES = ("products", "attention", "norms and sums", "barrier wait", "logits")


@dataclass
class StepPhases:
    """Seconds the fused step spent in each of STEP_PHASES (each call adds its team's mean, so a call's phases
    add up to its parallel region's wall time), over `calls` calls."""

    calls: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))


# This process's running totals, while anything counts (`count_step_phases`, `record_step_phases`): the C
# call adds into _TOTALS itself (atomically per phase), so counting costs a call its clock reads only.
_TOTALS = (ctypes.c_double * len(STEP_PHASES))()
_TOTALS_AT = ctypes.addressof(_TOTALS)
_counting = 0  # how many count: the services for good, a recording for its block
_calls = 0
_count_lock = threading.Lock()


def _check_phases() -> None:
    lib = load()
    if lib is not None and lib.specmesh_decode_step_phases() != len(STEP_PHASES):
        raise RuntimeError("decode_step_cpu.c's phases are not STEP_PHASES")


def count_step_phases() -> None:
    """Count the fused step's phases in this process from now on (a service's metrics: `step_phase_totals`)."""
    global _counting
    _check_phases()
    with _count_lock:
        _counting += 1


def _count_call() -> None:
    global _calls
    with _count_lock:
        _calls += 1


def step_phase_totals() -> StepPhases:
    """The phases' seconds and the calls counted in this process so far."""
    with _count_lock:
        return StepPhases(_calls, dict(zip(STEP_PHASES, _TOTALS, strict=True)))


@contextlib.contextmanager
def record_step_phases() -> Iterator[StepPhases]:
    """The fused step's phases over the calls made inside the block (any thread's), in the StepPhases it yields
    (filled when the block ends)."""
    global _counting
    count_step_phases()
    before, rec = step_phase_totals(), StepPhases()
    try:
        yield rec
    finally:
        after = step_phase_totals()
        with _count_lock:
            _counting -= 1
        rec.calls = after.calls - before.calls
        rec.seconds = {k: after.seconds[k] - before.seconds[k] for k in STEP_PHASES}


class DecodeStep:
    """A few tokens of one sequence through a whole decoder in one call (`csrc/decode_step_cpu.c`): token ids
    in, the last rows' logits out, the keys and values written into the KV where the block table says. A
    target-only step is one token, a verify block K + 1: their rows meet the same arithmetic (bit-identical
    logits for the same positions), so greedy speculation here is target-only decoding token for token.

    A decode step of one stream is 71 matrix-vector products on the demo target plus ~150 small operators
    (norms, rotary, the KV write, attention, the activation), each a Python call and a torch dispatch, and each
    product a fork and join of the thread team: the operators and joins cost the step ~2.5 ms of its ~8 over
    the weights' reads. Here the forward is one OpenMP region, five barriers a layer: on the demo target ~5 ms
    a step against the 4.3 ms its weights take to read at the machine's bandwidth. A block of rows reads the
    weights once for all of them; where the build has AVX-512 (or AVX2 and FMA) the step keeps its own copy of
    the projections in panels of 64 columns (16 with AVX2: `panels`), whose rows it multiplies in registers (a
    one-stream verify block of 5 rows ~1.2 one-token steps, against ~1.6 over the [in, out] rows).

    `dec` is a `static._FastDecoder` (its rotary tables and, without panels, its fused [in, out] weights are read
    in place);
    `reason(dec)` says why one cannot be built for it (None: it can). `panels_dtype` bfloat16: the panels'
    copies in bfloat16, where the build packs panels (float rows elsewhere), over float pools only: half the
    bytes a step streams (the demo draft's one-token step at one thread 0.65 -> 0.40 ms, four sequences' 0.93
    -> 0.74), for a model whose numerics may change, a draft's (its logits move by bfloat16's rounding of the
    weights, ~1e-3 of their scale on the demo draft)."""

    def __init__(self, dec, panels_dtype: torch.dtype = torch.float32) -> None:
        why = self.reason(dec)
        if why:
            raise ValueError(f"no fused decode step: {why}")
        lib = load()
        assert lib is not None  # reason() said it is built
        self.lib = lib
        self.dec = dec
        # Where this build packs the weights in panels, the step reads its own copy of them (one more copy of
        # the projections, in one huge-page region; the decoder's [in, out] rows stay for the ragged forward's
        # one-row products).
        width = lib.specmesh_decode_step_panel() if os.environ.get("SPECMESH_CPU_PANELS", "1") != "0" else 0
        if panels_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the fused step's panels are float32 or bfloat16, not {panels_dtype}")
        if not width:  # no panels in this build (neither AVX-512 nor AVX2): the float [in, out] rows
            panels_dtype = torch.float32
        self.entry = "specmesh_decode_step" + (PANELS_BF16 if panels_dtype == torch.bfloat16 else "")
        self.panels_dtype = panels_dtype
        mats = [_rows_of(w) for w in (*(layer[i] for layer in dec.layers for i in (2, 4, 11, 14)), dec.lm_w)]
        copies = pack_panels(mats, width, panels_dtype) if width else []
        packed = dict(zip(map(id, mats), copies, strict=False))  # none without panels

        def weights(w: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> int:
            return (packed[id(_rows_of(w))] if width else _rows_of(w)).data_ptr()

        # The tensors the pointers below point into, alive as long as this step is (the decoder may rebuild
        # its copies while another thread is still inside a call).
        self._held = (dec.layers, dec.lm_w, dec.lm_b, copies)
        n_layers = len(dec.layers)
        self._ptrs_t, self._dims_t = ctypes.c_void_p * (n_layers * _NPTR), ctypes.c_int64 * _NDIM
        self.ptrs = self._ptrs_t()
        self.fl = (ctypes.c_float * (n_layers * _NFL))()
        self.dims = self._dims_t()
        for i, (ln1, eps1, wqkv, bqkv, wo, bo, scale, qn, kn, ln2, eps2, wgu, bgu, _, wd, bd, _) in enumerate(
            dec.layers
        ):
            ptr: list[ctypes.c_void_p | int | None] = [None] * _NPTR
            ptr[_LN1], ptr[_WQKV], ptr[_BQKV] = ln1.data_ptr(), weights(wqkv), _ptr(bqkv)
            ptr[_WO], ptr[_BO] = weights(wo), _ptr(bo)
            ptr[_QN] = qn.weight.data_ptr() if qn is not None else None
            ptr[_KN] = kn.weight.data_ptr() if kn is not None else None
            ptr[_LN2], ptr[_WGU], ptr[_BGU] = ln2.data_ptr(), weights(wgu), _ptr(bgu)
            ptr[_WD], ptr[_BD] = weights(wd), _ptr(bd)
            self.ptrs[i * _NPTR : (i + 1) * _NPTR] = ptr
            qeps = qn.variance_epsilon if qn is not None else 0.0
            keps = kn.variance_epsilon if kn is not None else 0.0
            self.fl[i * _NFL : (i + 1) * _NFL] = [eps1, eps2, scale, qeps, keps]
        hidden, vocab, inter = dec.embed.shape[1], _rows_of(dec.lm_w).shape[0], dec.layers[0][13]
        small = sum(w.numel() * 4 for w in mats) <= STEP_SMALL_BYTES
        # tokens of one sequence in one call, and of all of them
        self.max_seq_rows = STEP_MAX_TOKENS_PANELS if width else STEP_MAX_TOKENS_SMALL if small else STEP_MAX_TOKENS
        self.max_rows = STEP_MAX_BATCH_TOKENS_PANELS if width else self.max_seq_rows
        self.dims[:7] = [hidden, dec.n_heads, dec.n_kv, dec.head_dim, inter, vocab, n_layers]
        self.dims[_PANELW] = width
        self.panel_width = width
        self.hidden, self.vocab = hidden, vocab
        self.lm_w, self.lm_b = weights(dec.lm_w), _ptr(dec.lm_b)

    @staticmethod
    def reason(dec) -> str | None:
        """Why a fused step cannot serve this decoder here, or None."""
        if load() is None:
            return "specmesh's CPU kernels are not built here"
        if dec.embed.device.type != "cpu" or dec.dtype != torch.float32:
            return "it runs float32 on a CPU"
        if dec.head_dim % 2 or dec.head_dim > 512:
            return f"head_dim {dec.head_dim}"
        if not (_dense(dec.embed) and _dense(dec.norm_w) and _dense(dec.lm_b) and _dense(dec.cos) and _dense(dec.sin)):
            return "embedding, norm or rotary tables not dense float32"
        if len({layer[13] for layer in dec.layers}) != 1:
            return "layers of different MLP widths"
        mats = [dec.lm_w]
        for ln1, _, wqkv, bqkv, wo, bo, _, qn, kn, ln2, _, wgu, bgu, _, wd, bd, act in dec.layers:
            if act is not torch.nn.functional.silu:
                return f"activation {act!r} (SiLU only)"
            if not all(_dense(t) for t in (ln1, ln2, bqkv, bo, bgu, bd)):
                return "norm weights or biases not dense float32"
            if any(n is not None and not _dense(getattr(n, "weight", None)) for n in (qn, kn)):
                return "q/k norm weights not dense float32"
            mats += [wqkv, wo, wgu, wd]
        for w in map(_rows_of, mats):
            if not (gemv_fits(w) and w.stride(1) == w.shape[0]):
                return f"a weight {tuple(w.shape)} with strides {w.stride()} is not [in, out] rows"
        return None

    def __call__(
        self,
        seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        block_size: int,
        num_logits: Sequence[int],
        strides: tuple[int, int, int, int] | None = None,
    ) -> torch.Tensor | None:
        """Logits [sum(num_logits), V] (None for none): per sequence (tokens, first position, block table), the
        last num_logits[i] of its tokens, sequence after sequence. Every token's key and value goes to slot
        table[p // block_size] * block_size + p % block_size of each layer's pools (one tensor per layer, float32
        or bfloat16, the head dimension contiguous; `strides`, in elements, (K head, K slot, V head, V slot), by
        default the pools' first two strides), and a token at position p attends over its sequence's positions
        [0, p]. At most `max_rows` tokens in all, `max_seq_rows` of one sequence. The caller has made the
        decoder's rotary tables reach the last position and checked the tokens against the vocabulary."""
        n = sum(len(t) for t, _, _ in seqs)
        step = _kv_entry(self.entry, k_pools[0], v_pools[0])  # a runner's pools share one dtype
        if step is None:
            pools = " or ".join(map(str, KV_DTYPES)) if self.panels_dtype == torch.float32 else "torch.float32"
            raise ValueError(f"the fused CPU step's KV pools are CPU {pools} tensors")
        if (
            not seqs
            or not 1 <= n <= self.max_rows
            or max(len(t) for t, _, _ in seqs) > self.max_seq_rows
            or any(not 0 <= k <= len(t) for (t, _, _), k in zip(seqs, num_logits, strict=True))
        ):
            raise ValueError(
                f"the fused CPU step takes 1 to {self.max_rows} tokens ({self.max_seq_rows} of a sequence) and up to "
                "as many logits rows"
            )
        # Per call: the draft service steps several sessions at once on worker threads.
        dec, dims, ptrs = self.dec, self._dims_t.from_buffer_copy(self.dims), self._ptrs_t.from_buffer_copy(self.ptrs)
        cos, sin = dec.cos, dec.sin  # held through the call: another thread may grow the tables meanwhile
        if strides is None:
            k0, v0 = k_pools[0], v_pools[0]
            strides = (k0.stride(0), k0.stride(1), v0.stride(0), v0.stride(1))
        # The arguments as ctypes arrays rather than tensors: a one-token step is ~4 ms, and each tensor built
        # here cost ~10 us with the caches cold from the step before (its weights' stream evicts them).
        width = max(1, max(len(b) for _, _, b in seqs))
        table: list[int] = []
        flat: list[int] = []
        segs: list[int] = []
        rows: list[int] = []
        for (tokens, start, blocks), wants in zip(seqs, num_logits, strict=True):
            table += blocks
            table += (0,) * (width - len(blocks))
            segs += (len(flat), len(tokens), start)
            flat += tokens
            rows += range(len(flat) - wants, len(flat))
        dims[_BS], dims[_NSEQ], dims[_NTOK], dims[_NLOG], dims[_TW] = block_size, len(seqs), n, len(rows), width
        dims[_K_SH], dims[_K_SS], dims[_V_SH], dims[_V_SS] = strides
        for i, (k, v) in enumerate(zip(k_pools, v_pools, strict=True)):
            ptrs[i * _NPTR + _KPOOL] = k.data_ptr()
            ptrs[i * _NPTR + _VPOOL] = v.data_ptr()
        i64 = ctypes.c_int64
        out = torch.empty((len(rows), self.vocab), dtype=torch.float32) if rows else None
        counting = _counting > 0
        with _profiled("specmesh::cpu_decode_step"):
            rc = step(
                dims,
                ptrs,
                self.fl,
                dec.embed.data_ptr(),
                (i64 * n)(*flat),
                (i64 * len(segs))(*segs),
                (ctypes.c_int32 * len(table))(*table),
                cos.data_ptr(),
                sin.data_ptr(),
                dec.norm_w.data_ptr(),
                float(dec.norm_eps),
                self.lm_w,
                self.lm_b,
                (i64 * len(rows))(*rows),
                out.data_ptr() if out is not None else None,
                torch.get_num_threads(),
                _TOTALS_AT if counting else None,
            )
        if rc:
            raise MemoryError("specmesh's fused CPU decode step could not allocate its scratch")
        if counting:
            _count_call()
        return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None
