#!/usr/bin/env python3
"""Build SGLang's CPU engine into a cached venv, for the cpu-tiny-sglang profile and the tests.

SGLang on CPU needs its CPU kernel package (`sgl_kernel`: C++ with AVX-512 and AMX intrinsics,
imported at start by sglang/srt/mem_cache/memory_pool.py). No registry publishes a CPU build of it
(PyPI's sglang-kernel and sgl-kernel wheels are CUDA builds), so it is built from SGLang's source
tree, for what the CPU runs. SGLang calls the kernel's ops only where it finds AMX
(cpu_has_amx_support gates each call: sglang/srt/layers/layernorm.py, activation.py,
rotary_embedding/, distributed/bootstrap.py) and runs its torch-native layers elsewhere, importing
the kernel only. So the kernel is built for SGLang's own target (x86-64-v4 with AVX-512 BF16 and
VNNI and AMX, its csrc/cpu/CMakeLists.txt) on a CPU with all of them, else for x86-64-v3 (AVX2),
which its sources build to through their CPU_CAPABILITY_AVX512 guards: an x86-64-v4 build stops
the import with an illegal instruction on a CPU without AVX-512 (an AMD EPYC without it, 2026-12).
The steps, each skipped when done (a lock keeps parallel runs apart):
  1. the machine: x86-64-v3 at least (AVX2), a C++ compiler, cmake and libnuma's header (Debian:
     build-essential cmake ninja-build libnuma-dev);
  2. the source, $ROOFLINE_SGLANG_SOURCE: a source tree, a tarball of one, or a git URL (cloned
     with git); default the upstream repository https://github.com/sgl-project/sglang.git;
  3. a venv under the cache with torch 2.13.0+cpu and the pinned runtime packages
     (scripts/data/sglang-cpu-requirements.txt says where they come from);
  4. torchvision: the registries have a CUDA build only, whose C ops do not load beside the CPU
     torch (`operator torchvision::nms does not exist`), and SGLang imports torchvision.transforms
     at start (sglang/srt/multimodal/internvl_utils.py). The installed file
     torchvision/_meta_registrations.py is patched here so that its fake-op registrations apply
     only when the ops loaded (torchvision.extension._has_ops()), as its register_meta already does;
  5. the kernel, from the source's CPU kernel folder (python/sglang/kernels/aot in 2026 trees,
     sgl-kernel before) and its pyproject_cpu.toml, for the CPU's target (above), on every core;
     its build's progress on stderr. A cached kernel built for another target (a cache moved
     between machines) is built again;
  6. SGLang: the released sglang==0.5.23 from the registry, without its (CUDA) requirements; with
     --from-source, or where the registry lacks it, the same tree's python/ package
     (pyproject_cpu.toml): the matched pair, which reports version 0.0.0.dev0;
  7. the tiny model the tests serve, <cache>/models/v2/tiny-qwen3, the one the CPU vLLM serves.

The released 0.5.23 expects kernel 0.4.10, whose CPU source is not published; beside the kernel of
the source (0.4.6.post1 in SGLang main of 2026-08) its default attention backend, intel_amx, fails
on the first forward (`extend_attention_cpu() expected at most 19 argument(s) but received 22`):
cpu-tiny-sglang runs --attention-backend torch_native, which serves on both. Without AMX (no
amx_tile or amx_bf16 in /proc/cpuinfo) SGLang uses its torch-native layers instead of the kernel's
AMX ones (sglang/srt/utils/common.py, cpu_has_amx_support): slower, and it serves; the result says so.

Cache dir: $ROOFLINE_CACHE_DIR, default ~/.cache/roofline; the venv is <cache>/sglang-cpu, built
once (--rebuild starts it over, e.g. after changing ROOFLINE_SGLANG_SOURCE).

Examples:
  setup_cpu_sglang.py                                   # the upstream repository (network)
  ROOFLINE_SGLANG_SOURCE=~/src/sglang setup_cpu_sglang.py
  ROOFLINE_SGLANG_SOURCE=sglang-src.tar.gz setup_cpu_sglang.py --json
  setup_cpu_sglang.py --from-source                     # SGLang too from the source tree

Exit codes: 0 ready, 2 ROOFLINE_SGLANG_SOURCE is no SGLang source, 3 something the build needs is
missing (one line says what) or a step failed (its output above).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import venv
from pathlib import Path
from typing import Any, Sequence

from rooflib.core import cli, printing
from rooflib.core.conf import cache_dir
from rooflib.core.errors import ServerError, UsageError
from rooflib.serving.engine_setup import MODELS_LOCK, ensure_model, locked, run

SGLANG_RELEASE = "0.5.23"
TORCH = "torch==2.13.0+cpu"
UPSTREAM = "https://github.com/sgl-project/sglang.git"
REQUIREMENTS = Path(__file__).resolve().parent / "data" / "sglang-cpu-requirements.txt"
TINY_MODEL = Path(__file__).resolve().parent / "tiny_model.py"
# Where a source tree keeps the CPU kernel (the first one that has pyproject_cpu.toml).
KERNEL_FOLDERS = ("python/sglang/kernels/aot", "sgl-kernel")
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16")
# SGLang's target for the kernel and what it takes: x86-64-v4 (AVX-512 F, BW, CD, DQ, VL) and the
# -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16 -mamx-int8 of csrc/cpu/CMakeLists.txt.
UPSTREAM_MARCH = "x86-64-v4"
UPSTREAM_CPU_FLAGS = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni",
                      "amx_tile", "amx_bf16", "amx_int8")
# Elsewhere the kernel is built for x86-64-v3 (https://gitlab.com/x86-psABIs/x86-64-ABI, its
# micro-architecture levels; as /proc/cpuinfo names them, abm being LZCNT).
PORTABLE_MARCH = "x86-64-v3"
PORTABLE_CPU_FLAGS = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
# The options of csrc/cpu/CMakeLists.txt that x86-64-v3 goes without, one to a line there.
UPSTREAM_ONLY_OPTION = re.compile(r"^\s*-m(?:avx512\w+|amx-[\w-]+)\s*$")
APT_PACKAGES = "build-essential cmake ninja-build libnuma-dev"
NUMA_HEADERS = (Path("/usr/include/numa.h"), Path("/usr/local/include/numa.h"))
BUILD_TOOLS = ["scikit-build-core>=0.10", "wheel", "setuptools>=61", "setuptools-scm>=8"]


def venv_dir() -> Path:
    return cache_dir() / "sglang-cpu"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def has_amx() -> bool:
    flags = cpu_flags()
    return all(flag in flags for flag in AMX_CPU_FLAGS)


def kernel_march(flags: set[str]) -> str:
    """What the kernel is compiled for on a CPU with these /proc/cpuinfo flags (the module's doc)."""
    return UPSTREAM_MARCH if all(flag in flags for flag in UPSTREAM_CPU_FLAGS) else PORTABLE_MARCH


def check_machine(source: str) -> None:
    """A ServerError naming the first things the build lacks."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ServerError(f"this set-up builds SGLang's CPU kernel for x86-64; this machine is {platform.machine()}")
    flags = cpu_flags()
    lacking = [flag for flag in PORTABLE_CPU_FLAGS if flag not in flags]
    if lacking:
        raise ServerError(f"this CPU lacks {', '.join(lacking)}: SGLang's CPU kernel is built for "
                          f"{PORTABLE_MARCH} (AVX2) at least")
    tools = {"a C++ compiler (g++)": shutil.which("g++") or shutil.which("c++"), "cmake": shutil.which("cmake"),
             "libnuma's header (libnuma-dev)": any(path.exists() for path in NUMA_HEADERS)}
    if is_git_url(source):
        tools["git (ROOFLINE_SGLANG_SOURCE is a git URL)"] = shutil.which("git")
    missing = [name for name, found in tools.items() if not found]
    if missing:
        raise ServerError(f"building SGLang's CPU kernel needs {', '.join(missing)}: "
                          f"apt-get install -y {APT_PACKAGES} (as root or with sudo)")


def is_git_url(source: str) -> bool:
    return source.startswith(("https://", "http://", "ssh://", "git://", "git@")) or source.endswith(".git")


def source_tree(source: str) -> Path:
    """The SGLang source tree `source` names: the folder itself, a tarball unpacked into the
    cache, or a clone into the cache (both kept for a later run)."""
    if is_git_url(source):
        dest = cache_dir() / "sglang-src" / f"git-{hashlib.sha256(source.encode()).hexdigest()[:12]}"
        if not dest.exists():
            run(["git", "clone", "--depth", "1", source, str(dest.with_suffix(".part"))], "cloning SGLang's source")
            dest.with_suffix(".part").rename(dest)
        return tree_root(dest, source)
    path = Path(source).expanduser()
    if path.is_dir():
        return tree_root(path, source)
    if path.is_file() and tarfile.is_tarfile(path):
        stat = path.stat()
        dest = cache_dir() / "sglang-src" / f"{path.name.split('.')[0]}-{stat.st_size}-{int(stat.st_mtime)}"
        if not dest.exists():
            unpack(path, dest)
        return tree_root(dest, source)
    raise UsageError(f"ROOFLINE_SGLANG_SOURCE={source}: neither a source tree, a tarball nor a git URL")


def unpack(tarball: Path, dest: Path) -> None:
    printing.progress(f"unpacking {tarball} into {dest}")
    part = dest.with_suffix(".part")
    shutil.rmtree(part, ignore_errors=True)
    with tarfile.open(tarball) as archive:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+: no links out of the folder, no devices
            archive.extractall(part, filter="data")
        else:
            archive.extractall(part)  # noqa: S202 - older Pythons; the user named this tarball
    part.rename(dest)


def tree_root(path: Path, source: str) -> Path:
    """The folder holding python/sglang: `path`, or its only folder (GitHub's tarballs have one)."""
    for candidate in (path, *sorted(p for p in path.iterdir() if p.is_dir())):
        if (candidate / "python" / "sglang").is_dir():
            return candidate
    raise UsageError(f"ROOFLINE_SGLANG_SOURCE={source}: no python/sglang in it, so not SGLang's source tree")


def kernel_folder(root: Path) -> Path:
    for name in KERNEL_FOLDERS:
        if (root / name / "pyproject_cpu.toml").is_file():
            return root / name
    raise UsageError(f"no CPU kernel in {root} (no {' or '.join(f'{n}/pyproject_cpu.toml' for n in KERNEL_FOLDERS)}): "
                     "an SGLang source tree from 2025 or later has one")


def project_version(pyproject: Path) -> str:
    found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
    return found.group(1) if found else "unknown"


def succeeds(python: Path, code: str) -> bool:
    return subprocess.run([str(python), "-c", code], capture_output=True).returncode == 0


def pip(python: Path, *args: str) -> list[str]:
    return [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args]


def install_runtime(python: Path) -> None:
    """torch 2.13.0+cpu (constrained, so that no requirement pulls a CUDA torch), the pinned
    packages, and what the builds need without isolation."""
    constraint = venv_dir() / "torch-constraint.txt"
    constraint.write_text(TORCH + "\n")
    try:
        run(pip(python, "-q", TORCH), "installing torch")
    except ServerError:
        raise ServerError(f"{TORCH} is not on this machine's package index: add PyTorch's CPU index "
                          "(PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) and run again")
    run(pip(python, "-q", "-c", str(constraint), "-r", str(REQUIREMENTS)), "installing SGLang's pinned requirements")
    run(pip(python, "-q", "-c", str(constraint), *BUILD_TOOLS), "installing the build tools")


# The patch of step 4: a guard the registrations go through, after the import they need.
TORCHVISION_ANCHOR = "import torchvision.extension  # noqa: F401\n"
TORCHVISION_GUARD = '''

def _register_fake_if_ops(name):
    # Added by Roofline's setup_cpu_sglang.py: this torchvision's C ops do not load beside the CPU torch.
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn
'''


def patch_torchvision(python: Path) -> None:
    if succeeds(python, "import torchvision.transforms"):
        return
    where = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print(u.find_spec('torchvision').submodule_search_locations[0])"],
                           capture_output=True, text=True)
    target = Path(where.stdout.strip() or ".") / "_meta_registrations.py"
    text = target.read_text() if target.is_file() else ""
    if TORCHVISION_ANCHOR not in text or "@torch.library.register_fake(" not in text:
        raise ServerError(f"torchvision does not import beside {TORCH} and {target} is not the file this "
                          "set-up knows how to patch: install a CPU torchvision built for that torch")
    printing.progress(f"patching {target}: fake-op registrations only where torchvision's C ops loaded")
    text = text.replace(TORCHVISION_ANCHOR, TORCHVISION_ANCHOR + TORCHVISION_GUARD, 1)
    target.write_text(text.replace("@torch.library.register_fake(", "@_register_fake_if_ops("))
    run([str(python), "-c", "import torchvision.transforms"], "checking the torchvision import")


def lower_march(cmake_lists: str) -> str:
    """The kernel's CMakeLists.txt with SGLang's x86-64-v4 and AMX options as one -march=x86-64-v3."""
    if f"-march={UPSTREAM_MARCH}" not in cmake_lists:
        raise ServerError(f"this CPU needs the kernel built for {PORTABLE_MARCH}, and this source's "
                          f"csrc/cpu/CMakeLists.txt has no -march={UPSTREAM_MARCH} to lower: use an SGLang "
                          "source tree of 2026, or a CPU with AVX-512 and AMX")
    kept = [line for line in cmake_lists.splitlines(keepends=True) if not UPSTREAM_ONLY_OPTION.match(line)]
    return "".join(kept).replace(f"-march={UPSTREAM_MARCH}", f"-march={PORTABLE_MARCH}")


def build_kernel(python: Path, folder: Path, march: str) -> None:
    """Build `folder` (the kernel's source) for `march` from a copy under the venv: the user's tree
    stays as it is."""
    if built_march(ready_record()) == march and succeeds(python, "import sgl_kernel"):
        return
    build = venv_dir() / "build" / "kernel"
    shutil.rmtree(build, ignore_errors=True)
    shutil.copytree(folder, build, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info"))
    shutil.copyfile(build / "pyproject_cpu.toml", build / "pyproject.toml")
    if march != UPSTREAM_MARCH:
        cmake_lists = build / "csrc" / "cpu" / "CMakeLists.txt"
        cmake_lists.write_text(lower_march(cmake_lists.read_text()))
    cores = str(os.cpu_count() or 1)
    printing.progress(f"building SGLang's CPU kernel {project_version(build / 'pyproject.toml')} for {march} on "
                      f"{cores} cores (a few minutes on 2 idle cores; the compiler's progress follows)")
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": cores, "VIRTUAL_ENV": str(venv_dir())}
    # --force-reinstall: a kernel of the same version built for the other target gives way; without
    # its requirements, which install_runtime put there under the CPU torch's constraint.
    run(pip(python, "-v", "--no-build-isolation", "--force-reinstall", "--no-deps", str(build)), "building the kernel",
        env=env)
    shutil.rmtree(build, ignore_errors=True)


def install_sglang(python: Path, root: Path, from_source: bool) -> str:
    """"release" (sglang 0.5.23 from the registry) or "source" (the tree's python/ package)."""
    if not from_source:
        try:
            run(pip(python, "-q", "--no-deps", f"sglang=={SGLANG_RELEASE}"), f"installing the released sglang {SGLANG_RELEASE}")
            return "release"
        except ServerError:
            printing.progress(f"no sglang {SGLANG_RELEASE} on this machine's package index: SGLang from the source tree")
    build = venv_dir() / "build" / "sglang"
    shutil.rmtree(build, ignore_errors=True)
    shutil.copytree(root / "python", build, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "kernels"))
    shutil.copyfile(build / "pyproject_cpu.toml", build / "pyproject.toml")
    for extra in ("LICENSE", "README.md"):  # the pyproject names them; a tarball of python/ may lack them
        if not (build / extra).exists() and (root / extra).exists():
            shutil.copyfile(root / extra, build / extra)
    env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION": "0.0.0"}
    run(pip(python, "-q", "--no-deps", "--no-build-isolation", str(build)), "installing SGLang from the source tree", env=env)
    shutil.rmtree(build, ignore_errors=True)
    return "source"


def built_march(record: dict[str, Any] | None) -> str:
    """The target a ready record's kernel was built for; records from before it was recorded (and a
    venv with none yet) are SGLang's own target's."""
    return (record or {}).get("kernel_march", UPSTREAM_MARCH)


def ready_record() -> dict[str, Any] | None:
    marker = venv_dir() / ".roofline-ready"
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def build(source: str, from_source: bool, march: str) -> dict[str, Any]:
    """Every step of the module's doc, into a fresh or half-built venv; what was built."""
    started = time.monotonic()
    root = source_tree(source)
    folder = kernel_folder(root)
    if not venv_python().exists():
        venv.create(venv_dir(), with_pip=True)
    python = venv_python()
    install_runtime(python)
    patch_torchvision(python)
    build_kernel(python, folder, march)
    built_from = install_sglang(python, root, from_source)
    version = subprocess.run([str(python), "-c", "import sglang; print(sglang.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    # The kernel too: SGLang's launcher imports it only when the server starts.
    run([str(python), "-c", "import sgl_kernel, sglang.launch_server"], "checking the SGLang import")
    record = {"sglang": version or "unknown", "built_from": built_from, "source": source,
              "kernel": project_version(folder / "pyproject_cpu.toml"), "kernel_march": march,
              "build_seconds": round(time.monotonic() - started)}
    (venv_dir() / ".roofline-ready").write_text(json.dumps(record))
    return record


def ensure_engine(source: str, from_source: bool, rebuild: bool) -> tuple[dict[str, Any], bool]:
    """The cached engine's record, built first where needed; whether it was built now."""
    if rebuild:
        shutil.rmtree(venv_dir(), ignore_errors=True)
    record = ready_record()
    march = kernel_march(cpu_flags())
    if record and built_march(record) == march:
        return {**record, "amx": has_amx()}, False
    check_machine(source)
    return {**build(source, from_source, march), "amx": has_amx()}, True


def summary(result: dict[str, Any], built_now: bool) -> str:
    minutes, seconds = divmod(result["build_seconds"], 60)
    when = f"built in {minutes} min {seconds:02d} s" if built_now else f"cached (built in {minutes} min {seconds:02d} s)"
    amx = "AMX present" if result["amx"] else "no AMX: SGLang runs its torch-native layers"
    return (f"SGLang {result['sglang']} ({result['built_from']}, kernel {result['kernel']} for "
            f"{built_march(result)}; {amx}) {when}: "
            f"{result['python']}\n  source: {result['source']}\n"
            + "\n".join(f"  {name}: {path}" for name, path in result["models"].items()))


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--from-source", action="store_true",
                   help=f"build SGLang itself from the source tree too, not the released {SGLANG_RELEASE}")
    p.add_argument("--rebuild", action="store_true", help="remove the cached engine and build it again")
    printing.add_output_args(p)
    args = p.parse_args(argv)

    def body() -> int:
        source = os.environ.get("ROOFLINE_SGLANG_SOURCE") or UPSTREAM
        with locked(cache_dir() / "sglang-setup.lock"):
            record, built_now = ensure_engine(source, args.from_source, args.rebuild)
        with locked(cache_dir() / MODELS_LOCK):
            models = {"tiny-qwen3": str(ensure_model("tiny-qwen3", venv_python(), TINY_MODEL))}
        result = {"python": str(venv_python()), **record, "models": models}
        return printing.emit(result, summary(result, built_now), args.output)

    return cli.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
