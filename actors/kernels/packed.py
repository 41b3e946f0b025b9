"""Decode-step products of float32 weights from a copy packed once at load
(``--packed-weights``).

For the products its small-matrix kernel does not take, OpenBLAS copies the
weight into panels on every call before it multiplies; at a decode step's few
rows that copy costs about what the multiply does (30% of a one-row decode's
CPU time on SmolLM2: docs/benchmarks.md, the decode-floor section).
``packed.cpp``, an mlx primitive built on first use, multiplies from panels
made once, with OpenBLAS's arithmetic, inside mlx's graph (no sync). The
products its small-matrix kernel does take (at one row, most of a small
model's attention and down products) run there too, from the weight where it
lies: that kernel's sums, on two threads where OpenBLAS runs it on one.

A product goes there only where that gives mlx's own bits: for each weight
shape (and bias or not) and each row count from 1 to 32, a sample product is
computed both ways when the model is installed, with the small-matrix sums and
with each K blocking OpenBLAS may use, and a row count whose results differ
(another BLAS, another CPU) keeps mlx's matmul. Everything else (more
rows, where OpenBLAS's own kernel is as fast: longer prefill chunks;
quantized or half-precision weights; a GPU) runs as before.

:func:`install` swaps the class of the model's exact ``nn.Linear`` modules,
and of a tied head's ``nn.Embedding`` (its ``as_linear``), for the subclasses
below and packs their weights: a second copy of those weights in memory,
counted in the model's weight bytes (none for a weight whose every routed row
count is the small-matrix kernel's). Runs on the GPU thread.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from .build import built, cpu_key

log = logging.getLogger("mlx_nursery.packed")

SOURCE = Path(__file__).with_name("packed.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC",
         "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx"]  # fmt: skip
MAX_ROWS = 32  # past this many rows OpenBLAS's own kernel is as fast (docs/batching.md)
# OpenBLAS's K block for single-precision GEMM differs by CPU; the checks find
# which one this machine's uses (320 on the AVX-512 kernels measured here).
BLOCKS = (320, 256, 384, 448, 512, 640, 192, 128)
_ATTR = "_mlx_nursery_packed"

_lock = threading.Lock()
_module: Any = None
_tried = False
# A route: the K blocks' edges of the packed kernel, or SMALL: the small-matrix
# kernel's sums, from the weight where it lies.
Route = tuple[int, ...]
SMALL: Route = ()
_routes: dict[tuple[int, int, bool], dict[int, Route]] = {}


def _build() -> Path | None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    include = Path(sysconfig.get_paths()["include"])
    if compiler is None or not (include / "Python.h").exists():
        log.info("no C++ compiler or Python headers: decode products keep mlx's matmul")
        return None
    try:
        import nanobind
    except ImportError:
        return None
    nb = Path(nanobind.__file__).parent
    lib = Path(mx.__file__).parent

    def command(out: Path) -> list[str]:
        return [
            compiler, *FLAGS, f"-I{include}", f"-I{nb / 'include'}",
            f"-I{nb / 'ext/robin_map/include'}", f"-I{lib / 'include'}", str(SOURCE),
            str(nb / "src/nb_combined.cpp"), f"-L{lib / 'lib'}", "-lmlx",
            f"-Wl,-rpath,{lib / 'lib'}", "-o", str(out),
        ]  # fmt: skip

    parts = [SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
             mx.__version__.encode(), nanobind.__version__.encode(),
             str(include).encode()]  # fmt: skip
    name = "_packed" + sysconfig.get_config_var("EXT_SUFFIX")
    return built(name, parts, command, "decode products keep mlx's matmul", timeout=300)


def _openblas() -> bool:
    """Whether this process runs OpenBLAS (the arithmetic the kernel reproduces)."""
    try:
        return "libopenblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


# OpenBLAS cores whose float32 GEMM has the small-matrix kernel (0.3.21: SkylakeX's
# family); others (Haswell, Zen: what 0.3.21 picks on an AMD CPU with AVX-512 too)
# always pack, so only the packed routes can give their bits.
SMALL_KERNEL_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")


def openblas_core() -> str | None:
    """The core OpenBLAS chose here (``openblas_get_corename``), or None: not OpenBLAS."""
    try:
        name = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return None
    name.restype = ctypes.c_char_p
    return name().decode()


def module() -> Any:
    """The built extension, or None (then mlx's matmul is used everywhere)."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            return None
        if "avx512f" not in cpu_key().split() or not _openblas():
            return None  # the kernel is written for AVX-512, and its sums are OpenBLAS's
        try:
            path = _build()
            if path is None:
                return None
            spec = importlib.util.spec_from_file_location("_packed", path)
            loaded = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded)
        except (OSError, ImportError, subprocess.SubprocessError) as exc:
            log.warning("packed weights unavailable (%s): mlx's matmul is used", exc)
            return None
        _module = loaded
        return loaded


def bounds(k: int, q: int) -> tuple[int, ...]:
    """Where OpenBLAS's level-3 driver cuts K, with K block ``q``: blocks of
    ``q`` while two or more are left, then what is left whole, or in two
    halves rounded up to 16 where it is over ``q``."""
    edges, at = [0], 0
    while at < k:
        size = k - at
        if size >= 2 * q:
            size = q
        elif size > q:
            size = (size // 2 + 15) // 16 * 16
        at += size
        edges.append(at)
    return tuple(edges)


def panels(weight: mx.array) -> mx.array:
    """``weight`` (n outputs x k) as panels of 16 outputs, k-major within each."""
    n, k = weight.shape
    return mx.contiguous(weight.reshape(n // 16, 16, k).transpose(0, 2, 1)).reshape(-1)


def routes(n: int, k: int, bias: bool) -> dict[int, Route]:
    """Row counts (1-32) whose product of an ``n x k`` weight comes out of one of
    the kernels with mlx's bits, each with its route: SMALL, or the packed
    kernel's K blocking."""
    shape = (n, k, bias)
    if shape in _routes:
        return _routes[shape]
    ext, found = module(), {}
    if ext is not None and k >= 16:
        # A wider weight never moves a product from OpenBLAS's packing path to its
        # small-matrix kernel (that kernel's limits are upper bounds on outputs x
        # rows and on M x N x K), and the packing path's sums do not depend on N:
        # a head of 262,144 outputs is checked on 4,096 of them. The small-matrix
        # kernel is checked on the whole weight.
        sample = min(n, 4096)
        w = mx.random.normal((sample, k), key=mx.random.key(sample * 31 + k))
        b = mx.random.normal((sample,), key=mx.random.key(k)) if bias else None
        packed = panels(w) if n % 16 == 0 else None
        for rows in range(1, MAX_ROWS + 1):
            x = mx.random.normal((rows, k), key=mx.random.key(rows))
            want = mx.addmm(b, x, w.T) if bias else x @ w.T
            if sample == n and mx.array_equal(want, ext.small_matmul(x, w, b)).item():
                found[rows] = SMALL
                continue
            for q in BLOCKS if packed is not None else ():
                edges = bounds(k, q)
                got = ext.packed_matmul(x, packed, sample, k, list(edges), b)
                if mx.array_equal(want, got).item():
                    found[rows] = edges
                    break
    _routes[shape] = found
    return found


def _panelled(found: Mapping[int, Route]) -> bool:
    """Whether some row count of a weight reads a packed copy."""
    return any(route != SMALL for route in found.values())


@attrs.define
class Packing:
    """One module's packed weight (None where every route is SMALL) and the
    row counts it serves."""

    panels: mx.array | None
    routes: dict[int, Route]
    figures: Figures


@attrs.define
class Figures:
    """One model's routed products: modules, their packed bytes, and calls run
    from the panels, with the small-matrix kernel's sums, or as before."""

    modules: int = 0
    bytes: int = 0
    packed: int = 0
    small: int = 0
    plain: int = 0


def _product(module: Any, x: mx.array, bias: mx.array | None) -> mx.array | None:
    packing: Packing = getattr(module, _ATTR)
    weight = module["weight"]
    n, k = weight.shape
    edges = packing.routes.get(x.size // k) if x.dtype == mx.float32 and x.size % k == 0 else None
    if edges is None:
        packing.figures.plain += 1
        return None
    if edges == SMALL:
        packing.figures.small += 1
        return _module.small_matmul(x, weight, bias)
    packing.figures.packed += 1
    return _module.packed_matmul(x, packing.panels, n, k, list(edges), bias)


class PackedLinear(nn.Linear):
    """``nn.Linear``; from its packed weight at the row counts that route there."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _product(self, x, self.get("bias"))
        return super().__call__(x) if y is None else y


class PackedEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied head) reads its packed weight."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _product(self, x, None)
        return super().as_linear(x) if y is None else y


_PACKED = {nn.Linear: PackedLinear, nn.Embedding: PackedEmbedding}


def _tied(names: Any) -> bool:
    """Whether a model with these module names reads its head from its embedding
    (mlx-lm's models name an untied head ``lm_head``)."""
    return not any(name.split(".")[-1] == "lm_head" for name in names)


def install(model: Any) -> Figures | None:
    """Pack the float32 weights of ``model``'s exact ``nn.Linear`` modules (and a
    tied head's embedding) that a decode step's rows can read with mlx's bits;
    None where nothing can (no extension, not a CPU, no shape routes)."""
    if mx.default_device().type != mx.DeviceType.cpu or module() is None:
        return None
    named = list(model.named_modules())
    tied = _tied([name for name, _ in named])
    figures = Figures()
    for _, m in named:
        kind = type(m)
        if kind not in _PACKED or (kind is nn.Embedding and not tied):
            continue
        weight = m["weight"]
        if weight.dtype != mx.float32 or weight.ndim != 2:
            continue
        found = routes(*weight.shape, kind is nn.Linear and "bias" in m)
        if not found:
            continue
        packing = Packing(panels(weight) if _panelled(found) else None, found, figures)
        if packing.panels is not None:
            mx.eval(packing.panels)
            figures.bytes += packing.panels.nbytes
        object.__setattr__(m, _ATTR, packing)
        m.__class__ = _PACKED[kind]
        figures.modules += 1
    if not figures.modules:
        return None
    object.__setattr__(model, _ATTR, figures)
    log.info("packed weights: %d products, %.0f MiB", figures.modules, figures.bytes / 2**20)
    return figures


def estimate(weights: Mapping[str, tuple[int, int, bool]]) -> int:
    """The bytes :func:`install` will pack for a model whose float32 2-D weights
    are ``weights`` (module name -> outputs, inputs, bias or not), before it is
    loaded (a model's charge: ``server.sizing.estimate``). Embeddings (``embed``
    in the name) count only where no ``lm_head`` is there: a tied head."""
    if mx.default_device().type != mx.DeviceType.cpu or module() is None:
        return 0
    tied = _tied(weights)
    total = 0
    for name, (n, k, bias) in weights.items():
        embedding = "embed" in name.split(".")[-1]
        if (tied or not embedding) and _panelled(routes(n, k, bias and not embedding)):
            total += n * k * 4
    return total


def uninstall(model: Any) -> None:
    """The model's products back as mlx-lm builds them (the panels freed)."""
    plain = {packed: base for base, packed in _PACKED.items()}
    for _, m in model.named_modules():
        if type(m) in plain:
            m.__class__ = plain[type(m)]
            object.__delattr__(m, _ATTR)
    if figures_of(model) is not None:
        object.__delattr__(model, _ATTR)


def figures_of(model: Any) -> Figures | None:
    return getattr(model, _ATTR, None)
