"""The embedded processor: WebAssembly programs run exactly on a jitted state machine.

``run(module, func, args)`` is the host API; ``python -m jaxinfer.processor.spec`` the conformance
runner. The pipeline: binary.py (decode) -> validate.py (typing rules) -> lower.py (micro-ISA,
isa.py) -> machine.py (the jitted loop, arithmetic in alu.py); instance.py holds module state.
"""

from jaxinfer.processor.instance import (
    CompiledModule,
    ExecResult,
    Instance,
    InvalidModule,
    MalformedModule,
    Unsupported,
    compile_module,
    run,
    run_slots,
)

__all__ = ["CompiledModule", "ExecResult", "Instance", "InvalidModule", "MalformedModule", "Unsupported",
           "compile_module", "run", "run_slots"]
