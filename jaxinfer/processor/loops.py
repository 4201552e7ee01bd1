"""The processor's loops: up to ``steps`` machine iterations, as a while loop, one CPU kernel or the Pallas kernel.

``advance`` is what the engine's step and the host API call. It sits above both the machine's
iteration (`py`) and the Pallas GPU kernel (`gpu_kernel.py`), which itself runs the
machine's iteration, so neither of those imports the other's caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata

from jaxinfer.processor import gpu_kernel
from jaxinfer.processor.isa import Status
from jaxinfer.processor.machine import MachineShape, Pending, apply_per_slot, apply_writes, no_writes, step
from jaxinfer.processor.machine_state import SCALAR, MachineState, pack_scalars, unpack_scalars


def advance(state: MachineState, code: jax.Array, steps: jax.Array, shape: MachineShape) -> MachineState:
    """Run up to ``steps`` iterations, stopping early when no slot is running.

    On the CPU the whole loop is compiled as one kernel; elsewhere (or with ``shape.loop == "while"``)
    it is an ordinary while loop whose writes are scatters.
    """
    if shape.loop == "while":
        return _advance(state, code, steps, shape, apply=apply_writes)
    if shape.loop == "pallas":
        return lax.platform_dependent(state, code, steps,
                                      cpu=functools.partial(gpu_kernel.advance, shape=shape, interpret=True),
                                      cuda=functools.partial(gpu_kernel.advance, shape=shape),
                                      default=functools.partial(_advance, shape=shape, apply=apply_writes))
    return lax.platform_dependent(state, code, steps, cpu=functools.partial(_advance_one_kernel, shape=shape),
                                  default=functools.partial(_advance, shape=shape, apply=apply_writes))


def _advance(state: MachineState, code: jax.Array, steps: jax.Array, shape: MachineShape,
             apply: Callable[[MachineState, Pending], MachineState]) -> MachineState:
    def keep_going(carry):
        iteration, scalars, *_ = carry
        return (iteration < steps) & jnp.any(scalars[:, SCALAR["status"]] == Status.RUNNING)

    def body(carry):
        iteration, scalars, registers, memory, trace, pending = carry
        current = apply(unpack_scalars(scalars, registers, memory, trace), pending)
        following, writes = step(current, code, shape)
        return iteration + 1, pack_scalars(following), following.registers, following.memory, following.trace, writes

    carry = (jnp.int32(0), pack_scalars(state), state.registers, state.memory, state.trace, no_writes(shape))
    _, scalars, registers, memory, trace, pending = lax.while_loop(keep_going, body, carry)
    return apply(unpack_scalars(scalars, registers, memory, trace), pending)


def _advance_one_kernel(state: MachineState, code: jax.Array, steps: jax.Array, shape: MachineShape
                        ) -> MachineState:
    """The loop as a call that XLA:CPU emits as a single function.

    XLA:CPU otherwise runs each fusion of the loop body as its own kernel, about 45 of them per
    iteration at roughly 100 ns each. A call carrying the frontend attribute ``xla_cpu_small_call``
    is compiled whole instead (the mechanism of XLA's own small-while-loop hoisting, whose size
    limit this loop exceeds), and ``inlineable="false"`` keeps XLA's call inliner from dissolving
    it. The call's operands must all be parameters, not constants, for the emitter to accept it,
    so the loop's initial carry is built inside the call.
    """
    looped = jax.jit(functools.partial(_advance, shape=shape, apply=apply_per_slot))(state, code, steps)
    return set_xla_metadata(looped, xla_cpu_small_call="true", inlineable="false")
