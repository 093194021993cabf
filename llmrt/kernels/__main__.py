"""`python -m llmrt.kernels`: build (or find cached) every kernel build this CPU can run, linear, attention and
the fused layer ops, and the step-graph interpreter; `make install` runs it."""
from __future__ import annotations

import sys

from llmrt.hardware import cpu_flags
from llmrt.kernels import ISA_NEEDS, load


def main() -> int:
    """Build each ISA's kernels the CPU supports; 0 when all built (or none apply), 1 when a build failed."""
    from llmrt.attention.cpu_paged import load_kernel

    failed = 0
    if load_kernel() is None:  # its warning says why; the torch attention backend still works
        print("llmrt attention kernel (cpu_paged): not built; the torch backend will be used", file=sys.stderr)
        failed += 1
    else:
        print("llmrt attention kernel (cpu_paged): ready")
    from llmrt.model.layers.fused import fused_ops

    fused = fused_ops()  # the build this CPU uses; its warning says why where it fails
    print(f"llmrt fused layer ops: {'ready (' + fused.isa + ')' if fused else 'not built; torch ops will be used'}")
    from llmrt.worker.step_graph import extension

    print(f"llmrt step graphs: {'ready' if extension() else 'not built; every step will run eagerly'}")
    isas = [isa for isa, needs in ISA_NEEDS.items() if set(needs) <= cpu_flags()]
    if not isas:
        print("llmrt kernels: this CPU has no AVX2+FMA; torch's paths will be used")
        return 1 if failed else 0
    for isa in isas:
        try:
            lib = load(isa)
        except Exception as e:  # report, keep going: torch's paths still work without them
            print(f"llmrt kernels ({isa}): build failed: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"llmrt kernels ({isa}): {lib.how} in {lib.seconds:.1f} s -> {lib.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
