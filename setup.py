"""Builds real_py._C: C++ always; CUDA sources when a CUDA torch and nvcc are present.

REAL_PY_CUDA=1 forces the CUDA build, REAL_PY_CUDA=0 disables it.
Fast path for development: `python setup.py build_ext --inplace` (incremental).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"


def sources(*kinds):
    out = []
    for line in (CSRC / "sources.txt").read_text().splitlines():
        line = line.split("#", 1)[0].split()
        if len(line) == 2 and line[0] in kinds:
            out.append(str(Path("csrc") / line[1]))
    return out


def want_cuda():
    flag = os.environ.get("REAL_PY_CUDA")
    if flag is not None:
        return flag == "1"
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def ext_modules():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    # No -std flag: torch's BuildExtension adds the standard its headers need (C++20 from torch
    # 2.13 on; torch 2.14 refuses C++17 with "#error C++20 or later compatible compiler").
    cxx = ["-O3", "-fvisibility=hidden"]
    if want_cuda():
        nvcc = [
            "-O3",
            "-gencode=arch=compute_80,code=sm_80",
            "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_90,code=compute_90",
        ]
        return [
            CUDAExtension(
                "real_py._C",
                sources("core", "torch", "cuda_torch", "cuda"),
                include_dirs=[str(CSRC)],
                define_macros=[("REAL_PY_WITH_CUDA", "1")],
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            )
        ]
    return [
        CppExtension(
            "real_py._C", sources("core", "torch"), include_dirs=[str(CSRC)], extra_compile_args=cxx
        )
    ]


def build_ext_cls():
    from torch.utils.cpp_extension import BuildExtension

    class Build(BuildExtension):
        def build_extension(self, ext):
            super().build_extension(ext)
            check_shared_libstdcxx(self.get_ext_fullpath(ext.name))

    return Build.with_options(use_ninja=True)


def check_shared_libstdcxx(so):
    """The extension must load libstdc++ as a shared library, the one torch uses. A compiler that
    finds only libstdc++.a (e.g. a relocated gcc wrapper such as /opt/gcc/bin/g++ on the GPU
    machine, set as CXX there) links a private copy into _C.so; the first error message then
    crashes the process (SIGSEGV in std::ostream inside c10::str, seen on the H200 machine)."""
    if not sys.platform.startswith("linux") or shutil.which("readelf") is None:
        return
    res = subprocess.run(["readelf", "-d", so], capture_output=True, text=True)
    if res.returncode != 0:  # not an ELF file we can read: nothing to say
        return
    if "libstdc++.so" not in res.stdout:
        raise RuntimeError(
            f"{so} does not link libstdc++.so: the C++ compiler ({os.environ.get('CXX', 'c++')}) "
            "linked libstdc++ statically, and torch's error paths would crash in it; rebuild with "
            "the system compiler, e.g. CC=/usr/bin/gcc CXX=/usr/bin/g++ (remove build/ first)"
        )


setup(
    packages=find_packages(include=["real_py", "real_py.*"]),
    ext_modules=ext_modules(),
    cmdclass={"build_ext": build_ext_cls()},
)
