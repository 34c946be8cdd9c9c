"""Symbolic dimensions: a dim is an int or a polynomial over named symbols (batch, seq, past).

Polynomials with integer coefficients are closed under the arithmetic shape inference
needs (reshape merges dims by product, concat adds them); they are bound to ints at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

Monomial = tuple[str, ...]  # sorted symbol names, repeated for powers; () is the constant term


@dataclass(frozen=True)
class Sym:
    terms: tuple[tuple[Monomial, int], ...]  # sorted, no zero coefficients

    @staticmethod
    def named(name: str) -> "Sym":
        if not name.isidentifier():
            raise ValueError(f"symbol name {name!r} is not an identifier")
        return Sym(((((name,)), 1),))

    @staticmethod
    def _make(acc: dict[Monomial, int]) -> "Dim":
        terms = tuple(sorted((m, c) for m, c in acc.items() if c != 0))
        if not terms:
            return 0
        if len(terms) == 1 and terms[0][0] == ():
            return terms[0][1]
        return Sym(terms)

    def _acc(self) -> dict[Monomial, int]:
        return dict(self.terms)

    def __add__(self, other: "Dim") -> "Dim":
        acc = self._acc()
        for m, c in _terms(other):
            acc[m] = acc.get(m, 0) + c
        return Sym._make(acc)

    __radd__ = __add__

    def __mul__(self, other: "Dim") -> "Dim":
        acc: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in _terms(other):
                m = tuple(sorted(m1 + m2))
                acc[m] = acc.get(m, 0) + c1 * c2
        return Sym._make(acc)

    __rmul__ = __mul__

    def __neg__(self) -> "Dim":
        return self * -1

    def __sub__(self, other: "Dim") -> "Dim":
        return self + (-1 * other)

    def __rsub__(self, other: "Dim") -> "Dim":
        return (-1 * self) + other

    def __floordiv__(self, other: "Dim") -> "Dim":
        """Exact division by an int or a single-term dim; anything else is not a polynomial."""
        if isinstance(other, Sym):
            if len(other.terms) != 1:
                raise ValueError(f"cannot divide {self} by {other}")
            (mono, coeff), = other.terms
        else:
            mono, coeff = (), int(other)
        acc: dict[Monomial, int] = {}
        for m, c in self.terms:
            rest = list(m)
            for sym in mono:
                if sym not in rest:
                    raise ValueError(f"{self} is not divisible by {other}")
                rest.remove(sym)
            if c % coeff:
                raise ValueError(f"{self} is not divisible by {other}")
            acc[tuple(rest)] = acc.get(tuple(rest), 0) + c // coeff
        return Sym._make(acc)

    def __rfloordiv__(self, other: "Dim") -> "Dim":
        if isinstance(other, int) and other == 0:
            return 0
        raise ValueError(f"cannot divide {other} by the symbolic {self}")

    def symbols(self) -> set[str]:
        return {s for m, _ in self.terms for s in m}

    def evaluate(self, env: Mapping[str, int]) -> int:
        total = 0
        for m, c in self.terms:
            v = c
            for s in m:
                if s not in env:
                    raise KeyError(f"symbol {s!r} is not bound")
                v *= env[s]
            total += v
        return total

    def render(self, prefix: str = "") -> str:
        parts = []
        for m, c in self.terms:
            factors = ([str(c)] if c != 1 or not m else []) + [prefix + x for x in m]
            parts.append("*".join(factors))
        return "(" + " + ".join(parts) + ")"

    def __str__(self) -> str:
        return self.render()[1:-1]


Dim = Union[int, Sym]
Shape = tuple[Dim, ...]


def _terms(d: Dim) -> tuple[tuple[Monomial, int], ...]:
    if isinstance(d, Sym):
        return d.terms
    return (((), int(d)),) if d != 0 else ()


def is_static(shape: Shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def numel(shape: Shape) -> Dim:
    n: Dim = 1
    for d in shape:
        n = d * n
    return n


def contiguous_strides(shape: Shape) -> tuple[Dim, ...]:
    strides: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        strides.append(acc)
        acc = d * acc
    return tuple(reversed(strides))


SYMBOL_PREFIX = "d_"  # generated code names symbol `seq` d_seq, so no symbol can shadow a generated name


def render_dim(d: Dim) -> str:
    """Python source for a dim; symbols are variables bound in the generated entry function."""
    return d.render(SYMBOL_PREFIX) if isinstance(d, Sym) else str(int(d))


def evaluate_dim(d: Dim, env: Mapping[str, int]) -> int:
    return d.evaluate(env) if isinstance(d, Sym) else int(d)


def format_shape(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def dim_floordiv(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    if isinstance(a, int):
        return Sym._make({(): a}) // b if a else 0
    return a // b


def from_sympy(expr) -> Dim:
    """A torch SymInt's sympy expression as a Dim; only integer polynomials are dims."""
    import sympy

    expr = sympy.expand(expr)
    if expr.is_Integer:
        return int(expr)
    syms = sorted(expr.free_symbols, key=lambda s: s.name)
    try:
        poly = sympy.Poly(expr, *syms)
    except sympy.PolynomialError as e:
        raise ValueError(f"symbolic dim {expr} is not a polynomial in its symbols") from e
    acc: dict[Monomial, int] = {}
    for powers, coeff in poly.terms():
        if not coeff.is_Integer:
            raise ValueError(f"symbolic dim {expr} has a non-integer coefficient")
        mono = tuple(sorted(name for sym, p in zip(syms, powers) for name in [sym.name] * p))
        acc[mono] = int(coeff)
    return Sym._make(acc)
