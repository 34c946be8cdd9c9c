"""The sixteen primitive ops of kiln's IR, defined once and grouped.

Every stage switches on these definitions: the importer lowers ATen ops to them, the
optimizer encodes them as e-graph terms, codegen renders them and the reference evaluator
runs them.
"""

from __future__ import annotations

import enum


class Op(enum.Enum):
    # leaves and movement (not among the sixteen compute primitives)
    INPUT = "Input"
    WEIGHT = "Weight"
    CONSTANT = "Constant"
    VIEW = "View"
    # unary
    EXP2 = "Exp2"
    LOG2 = "Log2"
    SIN = "Sin"
    SQRT = "Sqrt"
    RECIP = "Recip"
    # binary
    ADD = "Add"
    MUL = "Mul"
    MOD = "Mod"
    LESS_THAN = "LessThan"
    # select
    WHERE = "Where"
    # reduce
    SUM_REDUCE = "SumReduce"
    MAX_REDUCE = "MaxReduce"
    # data
    IOTA = "Iota"
    GATHER = "Gather"
    SCATTER = "Scatter"
    CAST = "Cast"


class GroupOp:
    Leaf = frozenset({Op.INPUT, Op.WEIGHT, Op.CONSTANT})
    Movement = frozenset({Op.VIEW})
    Unary = frozenset({Op.EXP2, Op.LOG2, Op.SIN, Op.SQRT, Op.RECIP})
    Binary = frozenset({Op.ADD, Op.MUL, Op.MOD, Op.LESS_THAN})
    Select = frozenset({Op.WHERE})
    Reduce = frozenset({Op.SUM_REDUCE, Op.MAX_REDUCE})
    Data = frozenset({Op.IOTA, Op.GATHER, Op.SCATTER, Op.CAST})
    # ops computed pointwise from same-shaped inputs: fusable into one loop nest
    Elementwise = Unary | Binary | Select | frozenset({Op.CAST})
    Primitive = Unary | Binary | Select | Reduce | Data


assert len(GroupOp.Primitive) == 16
