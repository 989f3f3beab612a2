"""Check a CUDA build of real_py._C without a GPU: it imports, and every op has a CUDA kernel.

    python scripts/check_cuda_ext.py build/cuda/lib/real_py/_C.cpython-311-x86_64-linux-gnu.so

Run with the CUDA torch the extension was built against (`make cuda-build` does both). Loading
the library runs its TORCH_LIBRARY / TORCH_LIBRARY_IMPL registrations; the check then asks the
dispatcher, per op of the real_py namespace, for a CPU and a CUDA kernel. No CUDA call is made.
"""

import importlib.machinery
import importlib.util
import sys

import torch


def main(path: str) -> int:
    if torch.version.cuda is None:
        print(
            f"error: torch {torch.__version__} is a CPU build; run this with the CUDA torch",
            file=sys.stderr,
        )
        return 2
    # The pybind module is named _C; load it under that name (PyInit__C) without the package.
    loader = importlib.machinery.ExtensionFileLoader("_C", path)
    spec = importlib.util.spec_from_file_location("_C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    ops = sorted(s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("real_py::"))
    if not ops:
        print(f"error: {path} registered no real_py:: ops", file=sys.stderr)
        return 1
    missing = [
        (op, key)
        for op in ops
        for key in ("CPU", "CUDA")
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    ]
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); {path}")
    print(
        f"ops: {', '.join(ops)}; pybind functions: "
        f"{len([n for n in dir(module) if not n.startswith('_')])}"
    )
    if missing:
        print(
            "error: no kernel for " + ", ".join(f"{op} on {key}" for op, key in missing),
            file=sys.stderr,
        )
        return 1
    print("every op has CPU and CUDA kernels")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
