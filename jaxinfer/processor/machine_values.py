"""What each record computes, elementwise over the slots: the value table by opcode (i32 words,
i64 word pairs, constants, moves, selects, loads, calls and returns), picked without branches, and
64-bit division, the machine's only real branch, computed only in iterations where some slot divides.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.processor import alu
from jaxinfer.processor.isa import Op

U32 = jnp.uint32


def _i32_results(x: alu.Pair, y: alu.Pair) -> dict[Op, jax.Array]:
    a, b = x[0], y[0]
    sa, sb = alu.as_signed(a), alu.as_signed(b)
    division = alu.divide32(a, b)
    shift = b & U32(31)
    return {
        Op.I32_EQZ: alu.flag(a == 0), Op.I32_CLZ: lax.clz(a), Op.I32_CTZ: alu.count_trailing_zeros(a),
        Op.I32_POPCNT: lax.population_count(a), Op.I32_EXT8: alu.sign_extend(a, 8),
        Op.I32_EXT16: alu.sign_extend(a, 16),
        Op.I32_ADD: a + b, Op.I32_SUB: a - b, Op.I32_MUL: a * b,
        Op.I32_DIV_S: division["div_s"], Op.I32_DIV_U: division["div_u"],
        Op.I32_REM_S: division["rem_s"], Op.I32_REM_U: division["rem_u"],
        Op.I32_AND: a & b, Op.I32_OR: a | b, Op.I32_XOR: a ^ b,
        Op.I32_SHL: a << shift, Op.I32_SHR_S: alu.as_unsigned(sa >> shift.astype(jnp.int32)),
        Op.I32_SHR_U: a >> shift, Op.I32_ROTL: alu.rotate_left32(a, b), Op.I32_ROTR: alu.rotate_right32(a, b),
        Op.I32_EQ: alu.flag(a == b), Op.I32_NE: alu.flag(a != b),
        Op.I32_LT_S: alu.flag(sa < sb), Op.I32_LT_U: alu.flag(a < b),
        Op.I32_GT_S: alu.flag(sa > sb), Op.I32_GT_U: alu.flag(a > b),
        Op.I32_LE_S: alu.flag(sa <= sb), Op.I32_LE_U: alu.flag(a <= b),
        Op.I32_GE_S: alu.flag(sa >= sb), Op.I32_GE_U: alu.flag(a >= b),
    }


def _i64_results(x: alu.Pair, y: alu.Pair) -> dict[Op, alu.Pair]:
    zero = jnp.zeros_like(x[0])
    less_signed, less_unsigned = alu.less64(x, y, True), alu.less64(x, y, False)
    greater_signed, greater_unsigned = alu.less64(y, x, True), alu.less64(y, x, False)
    equal = (x[0] == y[0]) & (x[1] == y[1])

    def boolean(condition: jax.Array) -> alu.Pair:
        return alu.flag(condition), zero

    def extended(low: jax.Array) -> alu.Pair:
        return low, alu.sign_word(low)

    return {
        Op.I64_EQZ: boolean((x[0] | x[1]) == 0), Op.I64_CLZ: (alu.clz64(x), zero), Op.I64_CTZ: (alu.ctz64(x), zero),
        Op.I64_POPCNT: (lax.population_count(x[0]) + lax.population_count(x[1]), zero),
        Op.I64_EXT8: extended(alu.sign_extend(x[0], 8)), Op.I64_EXT16: extended(alu.sign_extend(x[0], 16)),
        Op.I64_EXT32: extended(x[0]), Op.I64_EXTEND_S: extended(x[0]), Op.I64_EXTEND_U: (x[0], zero),
        Op.I64_WRAP: (x[0], zero),
        Op.I64_ADD: alu.add64(x, y), Op.I64_SUB: alu.sub64(x, y), Op.I64_MUL: alu.mul64(x, y),
        Op.I64_AND: (x[0] & y[0], x[1] & y[1]), Op.I64_OR: (x[0] | y[0], x[1] | y[1]),
        Op.I64_XOR: (x[0] ^ y[0], x[1] ^ y[1]),
        Op.I64_SHL: alu.shl64(x, y[0]), Op.I64_SHR_S: alu.shr64(x, y[0], signed=True),
        Op.I64_SHR_U: alu.shr64(x, y[0], signed=False), Op.I64_ROTL: alu.rotl64(x, y[0]),
        Op.I64_ROTR: alu.rotr64(x, y[0]),
        Op.I64_EQ: boolean(equal), Op.I64_NE: boolean(~equal),
        Op.I64_LT_S: boolean(less_signed), Op.I64_LT_U: boolean(less_unsigned),
        Op.I64_GT_S: boolean(greater_signed), Op.I64_GT_U: boolean(greater_unsigned),
        Op.I64_LE_S: boolean(~greater_signed), Op.I64_LE_U: boolean(~greater_unsigned),
        Op.I64_GE_S: boolean(~less_signed), Op.I64_GE_U: boolean(~less_unsigned),
    }


_DIVIDE64 = (Op.I64_DIV_S, Op.I64_DIV_U, Op.I64_REM_S, Op.I64_REM_U)


def _divide64(op: jax.Array, x: alu.Pair, y: alu.Pair, executing: jax.Array) -> alu.Pair:
    """64-bit quotient or remainder, computed only in iterations where some slot divides."""
    dividing = executing & (op >= min(_DIVIDE64)) & (op <= max(_DIVIDE64))
    signed = (op == Op.I64_DIV_S) | (op == Op.I64_REM_S)
    remainder = (op == Op.I64_REM_S) | (op == Op.I64_REM_U)

    # Both branches take their inputs as operands and compute what they return (Triton's lowering
    # of a cond yields only values made inside it).
    def divide(operands):
        x, y, signed, remainder = operands
        quotient, rest = alu.divide64(x, y, signed)
        return jnp.where(remainder, rest[0], quotient[0]), jnp.where(remainder, rest[1], quotient[1])

    def skip(operands):
        x = operands[0]
        return x[0] ^ x[0], x[1] ^ x[1]

    some = dividing if dividing.ndim == 0 else jnp.any(dividing)  # one slot's scalars: no reduction (Triton)
    return lax.cond(some, divide, skip, (x, y, signed, remainder))


def record_value(state, record, x, y, z, loaded, executing, select: Callable = lax.select_n) -> alu.Pair:
    op = record.op
    zero = jnp.zeros_like(x[0])
    table: dict[Op, alu.Pair] = {
        Op.CONST: (alu.as_unsigned(record.imm), alu.as_unsigned(record.imm2)),
        Op.MOV: x,
        Op.SELECT: (jnp.where(z[0] != 0, x[0], y[0]), jnp.where(z[0] != 0, x[1], y[1])),
        Op.LOAD: loaded,
        Op.MSIZE: (state.pages.astype(U32), zero),
        Op.CALL: (alu.as_unsigned(state.pc + 1), alu.as_unsigned(state.fp)),
        Op.RETURN: z,
    }
    table.update({key: (word, zero) for key, word in _i32_results(x, y).items()})
    table.update(_i64_results(x, y))
    quotient = _divide64(op, x, y, executing)
    table.update(dict.fromkeys(_DIVIDE64, quotient))
    cases = [table.get(Op(code), (zero, zero)) for code in range(len(Op))]
    return select(op, *[pair[0] for pair in cases]), select(op, *[pair[1] for pair in cases])
