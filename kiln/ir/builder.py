"""GraphBuilder: appends nodes with shape and dtype inference, sharing identical nodes."""

from __future__ import annotations

import dataclasses

from kiln.ir import view as views
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Node, TensorSpec, validate
from kiln.ir.ops import GroupOp, Op
from kiln.ir.shape import Shape, format_shape
from kiln.ir.view import ViewSpec


class NodeId(int):
    """A node's index; a distinct type so lowerings can tell tensors from Python scalars."""


class GraphBuilder:
    def __init__(self):
        self.nodes: list[Node] = []
        self._index: dict[tuple, int] = {}
        self.inputs: list[TensorSpec] = []
        self.weights: list[TensorSpec] = []
        self.source = ""  # set by the importer to the ATen op being lowered

    def node(self, i: int) -> Node:
        return self.nodes[i]

    def shape(self, i: int) -> Shape:
        return self.nodes[i].shape

    def dtype(self, i: int) -> DType:
        return self.nodes[i].dtype

    @staticmethod
    def _key(node: Node) -> tuple:  # what makes two nodes the same node (not their source)
        return (node.op, node.inputs, node.shape, node.dtype, node.name, node.value, node.view, node.axis,
                node.kernel, node.schedule)

    def _add(self, node: Node) -> int:
        key = self._key(node)
        if key in self._index:
            return NodeId(self._index[key])
        node = Node(node.op, node.inputs, node.shape, node.dtype, node.name, node.value, node.view,
                    node.axis, self.source, node.kernel, node.schedule)
        self.nodes.append(node)
        self._index[key] = len(self.nodes) - 1
        return NodeId(len(self.nodes) - 1)

    def copy(self, node: Node, inputs) -> int:
        """The same operation as `node` on new inputs (shapes and dtypes are the node's own)."""
        if node.op is Op.INPUT:
            return self.input(node.name, node.shape, node.dtype)
        if node.op is Op.WEIGHT:
            return self.weight(node.name, node.shape, node.dtype)
        if node.op is Op.VIEW and node.view.is_contiguous_of(self.shape(inputs[0])):
            return NodeId(inputs[0])
        return self._add(Node(node.op, tuple(inputs), node.shape, node.dtype, node.name, node.value, node.view,
                              node.axis, kernel=node.kernel, schedule=node.schedule))

    def set_schedule(self, i: int, schedule: str) -> None:
        """Record the search's schedule for the kernel rooted at node i (kiln.ir.graph.parse_schedule),
        in place: a schedule says how to compute the node, never what it computes."""
        old = self.nodes[i]
        new = dataclasses.replace(old, schedule=schedule)
        self._index.pop(self._key(old), None)
        self.nodes[i] = new
        self._index[self._key(new)] = i

    # ---- leaves ----
    def input(self, name: str, shape: Shape, dtype: DType) -> int:
        spec = TensorSpec(name, tuple(shape), dtype)
        if spec not in self.inputs:
            self.inputs.append(spec)
        return self._add(Node(Op.INPUT, (), tuple(shape), dtype, name=name))

    def weight(self, name: str, shape: Shape, dtype: DType) -> int:
        spec = TensorSpec(name, tuple(shape), dtype)
        if spec not in self.weights:
            self.weights.append(spec)
        return self._add(Node(Op.WEIGHT, (), tuple(shape), dtype, name=name))

    def const(self, value: float, dtype: DType, shape: Shape = ()) -> int:
        if dtype is DType.BOOL:
            value = float(bool(value))
        elif not dtype.is_float:
            value = float(int(value))
        c = self._add(Node(Op.CONSTANT, (), (), dtype, value=float(value)))
        return self.expand(c, tuple(shape)) if shape else c

    def iota(self, shape: Shape, axis: int, dtype: DType = DType.I64) -> int:
        """Index along `axis`, broadcast over the other dims."""
        return self._add(Node(Op.IOTA, (), tuple(shape), dtype, axis=axis))

    # ---- movement ----
    def view(self, x: int, spec: ViewSpec) -> int:
        if spec.is_contiguous_of(self.shape(x)):
            return NodeId(x)
        return self._add(Node(Op.VIEW, (x,), tuple(spec.shape), self.dtype(x), view=spec))

    def reshape(self, x: int, shape: Shape) -> int:
        return self.view(x, views.reshape(self.shape(x), tuple(shape)))

    def permute(self, x: int, perm) -> int:
        return self.view(x, views.permute(self.shape(x), tuple(perm)))

    def expand(self, x: int, shape: Shape) -> int:
        return self.view(x, views.expand(self.shape(x), tuple(shape)))

    # ---- compute ----
    def unary(self, op: Op, x: int) -> int:
        assert op in GroupOp.Unary
        return self._add(Node(op, (x,), self.shape(x), self.dtype(x)))

    def broadcast(self, *xs: int) -> list[int]:
        shapes = [self.shape(x) for x in xs]
        out = broadcast_shapes(*shapes)
        return [self.expand(x, out) if self.shape(x) != out else x for x in xs]

    def binary(self, op: Op, a: int, b: int, kernel: str = "") -> int:
        assert op in GroupOp.Binary
        if self.dtype(a) != self.dtype(b):
            raise ValueError(f"{op.value}: dtypes differ ({self.dtype(a).value}, {self.dtype(b).value})")
        a, b = self.broadcast(a, b)
        dtype = DType.BOOL if op is Op.LESS_THAN else self.dtype(a)
        return self._add(Node(op, (a, b), self.shape(a), dtype, kernel=kernel))

    def where(self, cond: int, a: int, b: int) -> int:
        if self.dtype(cond) is not DType.BOOL:
            raise ValueError("Where: condition must be bool")
        cond, a, b = self.broadcast(cond, a, b)
        return self._add(Node(Op.WHERE, (cond, a, b), self.shape(a), self.dtype(a)))

    def reduce(self, op: Op, x: int, axis: int, kernel: str = "") -> int:
        assert op in GroupOp.Reduce
        shape = list(self.shape(x))
        axis = axis % len(shape)
        shape[axis] = 1
        return self._add(Node(op, (x,), tuple(shape), self.dtype(x), axis=axis, kernel=kernel))

    def cast(self, x: int, dtype: DType) -> int:
        if self.dtype(x) is dtype:
            return NodeId(x)
        return self._add(Node(Op.CAST, (x,), self.shape(x), dtype))

    def gather(self, src: int, index: int, axis: int) -> int:
        return self._add(Node(Op.GATHER, (src, index), self.shape(index), self.dtype(src), axis=axis))

    def scatter(self, dst: int, index: int, src: int, axis: int) -> int:
        return self._add(Node(Op.SCATTER, (dst, index, src), self.shape(dst), self.dtype(dst), axis=axis))

    def build(self, outputs, output_names=(), output_tree="", symbols=()) -> Graph:
        g = Graph(tuple(self.nodes), tuple(self.inputs), tuple(self.weights), tuple(outputs),
                  tuple(output_names), output_tree, tuple(symbols))
        validate(g)
        return g


def broadcast_shapes(*shapes: Shape) -> Shape:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = {s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ValueError("shapes do not broadcast: " + ", ".join(format_shape(s) for s in shapes))
        out.append(dims.pop() if dims else 1)
    return tuple(out)
