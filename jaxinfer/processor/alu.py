"""Integer arithmetic of the machine: i32 on uint32 words, i64 on (low, high) uint32 pairs.

Nothing here needs ``jax_enable_x64``, so it runs on TPU as on the CPU and GPU. Every function is
elementwise over slots and branch-free; 64-bit division, the one costly operation, is its own
function that the machine calls under a ``lax.cond`` only when some slot divides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

U32 = jnp.uint32
Pair = tuple[jax.Array, jax.Array]


def as_signed(word: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(word, jnp.int32)


def as_unsigned(word: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(word, U32)


def flag(condition: jax.Array) -> jax.Array:
    return condition.astype(U32)


def sign_word(word: jax.Array) -> jax.Array:
    """All ones when the 32-bit word is negative, else zero (the high word of its sign extension)."""
    return as_unsigned(as_signed(word) >> 31)


def sign_extend(word: jax.Array, bits: int) -> jax.Array:
    shift = 32 - bits
    return as_unsigned(as_signed(word << shift) >> shift)


def count_trailing_zeros(word: jax.Array) -> jax.Array:
    return lax.population_count(~word & (word - U32(1)))


def shift_left_word(word: jax.Array, amount: jax.Array) -> jax.Array:
    """word << amount for amounts 0..32 (32 gives 0), independent of the backend's shift rules."""
    return jnp.where(amount >= 32, U32(0), word << jnp.minimum(amount, 31))


def shift_right_word(word: jax.Array, amount: jax.Array) -> jax.Array:
    return jnp.where(amount >= 32, U32(0), word >> jnp.minimum(amount, 31))


# 32-bit ----------------------------------------------------------------------------------------


def rotate_left32(word: jax.Array, amount: jax.Array) -> jax.Array:
    amount = amount & U32(31)
    return (word << amount) | shift_right_word(word, U32(32) - amount)


def rotate_right32(word: jax.Array, amount: jax.Array) -> jax.Array:
    amount = amount & U32(31)
    return (word >> amount) | shift_left_word(word, U32(32) - amount)


def divide32(x: jax.Array, y: jax.Array) -> dict[str, jax.Array]:
    """Quotients and remainders with the divisor made safe; the traps are checked by the caller."""
    safe_unsigned = jnp.where(y == 0, U32(1), y)
    xs, ys = as_signed(x), as_signed(y)
    safe_signed = jnp.where((y == 0) | (ys == -1), 1, ys)
    quotient_signed = jnp.where(ys == -1, -xs, lax.div(xs, safe_signed))
    return {
        "div_u": x // safe_unsigned,
        "rem_u": x % safe_unsigned,
        "div_s": as_unsigned(quotient_signed),
        "rem_s": as_unsigned(jnp.where(ys == -1, 0, lax.rem(xs, safe_signed))),
    }


# 64-bit pairs ----------------------------------------------------------------------------------


def add64(x: Pair, y: Pair) -> Pair:
    low = x[0] + y[0]
    return low, x[1] + y[1] + flag(low < x[0])


def sub64(x: Pair, y: Pair) -> Pair:
    return x[0] - y[0], x[1] - y[1] - flag(x[0] < y[0])


def negate64(x: Pair) -> Pair:
    return sub64((jnp.zeros_like(x[0]), jnp.zeros_like(x[1])), x)


def multiply_words(x: jax.Array, y: jax.Array) -> Pair:
    """The full 64-bit product of two 32-bit words, from four 16-bit partial products."""
    mask = U32(0xFFFF)
    x0, x1, y0, y1 = x & mask, x >> 16, y & mask, y >> 16
    p00, p01, p10, p11 = x0 * y0, x0 * y1, x1 * y0, x1 * y1
    middle = (p00 >> 16) + (p01 & mask) + (p10 & mask)
    low = (p00 & mask) | (middle << 16)
    high = p11 + (p01 >> 16) + (p10 >> 16) + (middle >> 16)
    return low, high


def mul64(x: Pair, y: Pair) -> Pair:
    low, high = multiply_words(x[0], y[0])
    return low, high + x[0] * y[1] + x[1] * y[0]


def shl64(x: Pair, amount: jax.Array) -> Pair:
    amount = amount & U32(63)
    small = amount & U32(31)
    wide = amount >= 32
    low = jnp.where(wide, U32(0), x[0] << small)
    high = jnp.where(wide, x[0] << small, (x[1] << small) | shift_right_word(x[0], U32(32) - small))
    return low, high


def shr64(x: Pair, amount: jax.Array, signed: bool) -> Pair:
    amount = amount & U32(63)
    small = amount & U32(31)
    wide = amount >= 32
    high_shifted = as_unsigned(as_signed(x[1]) >> small) if signed else x[1] >> small
    fill = sign_word(x[1]) if signed else U32(0)
    low = jnp.where(wide, high_shifted, (x[0] >> small) | shift_left_word(x[1], U32(32) - small))
    high = jnp.where(wide, jnp.broadcast_to(fill, x[1].shape), high_shifted)
    return low, high


def rotl64(x: Pair, amount: jax.Array) -> Pair:
    left, right = shl64(x, amount), shr64(x, U32(64) - (amount & U32(63)), signed=False)
    return left[0] | right[0], left[1] | right[1]


def rotr64(x: Pair, amount: jax.Array) -> Pair:
    right, left = shr64(x, amount, signed=False), shl64(x, U32(64) - (amount & U32(63)))
    return left[0] | right[0], left[1] | right[1]


def less64(x: Pair, y: Pair, signed: bool) -> jax.Array:
    high_less = as_signed(x[1]) < as_signed(y[1]) if signed else x[1] < y[1]
    return high_less | ((x[1] == y[1]) & (x[0] < y[0]))


def clz64(x: Pair) -> jax.Array:
    return jnp.where(x[1] != 0, lax.clz(x[1]), U32(32) + lax.clz(x[0]))


def ctz64(x: Pair) -> jax.Array:
    return jnp.where(x[0] != 0, count_trailing_zeros(x[0]), U32(32) + count_trailing_zeros(x[1]))


def _unsigned_divmod64(numerator: Pair, divisor: Pair) -> tuple[Pair, Pair]:
    """Restoring long division, one quotient bit per iteration (64 iterations)."""

    def body(bit, carry):
        quotient, remainder = carry
        index = U32(63) - bit.astype(U32)
        word = jnp.where(index >= 32, numerator[1], numerator[0])
        incoming = (word >> (index & U32(31))) & U32(1)
        shifted = shl64(remainder, U32(1))
        remainder = (shifted[0] | incoming, shifted[1])
        fits = ~less64(remainder, divisor, signed=False)
        reduced = sub64(remainder, divisor)
        remainder = (jnp.where(fits, reduced[0], remainder[0]), jnp.where(fits, reduced[1], remainder[1]))
        quotient = shl64(quotient, U32(1))
        quotient = (quotient[0] | flag(fits), quotient[1])
        return quotient, remainder

    zero = jnp.zeros_like(numerator[0])
    return lax.fori_loop(0, 64, body, ((zero, zero), (zero, zero)))


def divide64(x: Pair, y: Pair, signed: jax.Array) -> tuple[Pair, Pair]:
    """i64 quotient and remainder (signed where ``signed``), with a zero divisor made safe."""
    safe = (jnp.where((y[0] | y[1]) == 0, U32(1), y[0]), y[1])
    x_negative = signed & (as_signed(x[1]) < 0)
    y_negative = signed & (as_signed(safe[1]) < 0)
    quotient, remainder = _unsigned_divmod64(_select64(x_negative, negate64(x), x),
                                             _select64(y_negative, negate64(safe), safe))
    return (_select64(x_negative ^ y_negative, negate64(quotient), quotient),
            _select64(x_negative, negate64(remainder), remainder))


def _select64(condition: jax.Array, when_true: Pair, when_false: Pair) -> Pair:
    return jnp.where(condition, when_true[0], when_false[0]), jnp.where(condition, when_true[1], when_false[1])
