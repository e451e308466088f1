"""What one micro-batch costs a model, block by block, measured on the meta device.

The model runs forward and backward on meta tensors (nothing allocated, any size) under a
dispatch mode that records every op torch runs: its FLOPs (torch's own formulas,
``torch.utils.flop_counter``) and the bytes it reads and writes (its tensor arguments and
results), and a matmul's shape. The cost model turns each op into time with a roofline,
``max(FLOPs / throughput, bytes / memory bandwidth)``, so memory-bound ops (norms, activations)
count at their real cost instead of their FLOPs; a calibrated device's matmul throughput
depends on the shape (a small batch's matmuls run far below a square one's).

It runs block by block (``mpt.pipeline.split.ordered_blocks``: what a pipeline cuts between) so
that every pipeline split the enumeration tries is priced from the same records, and records
what crosses each cut (the block's output) and what autograd saves (``mpt.estimate``'s count,
with the block's input marked where the previous block saves it too, so that a stage counts
that tensor once). A fused attention kernel's causal mask halves its FLOPs, which torch's
formulas count whole.
Under tensor parallelism (``tensor_parallel_plan()``), the ops inside the modules the plan
splits are marked: they divide over the tp ranks; a ``rowwise`` module's output is summed over
them in the forward, a ``colwise`` module's input gradient in the backward (Megatron's four
allreduces per transformer block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from mpt.errors import UsageError
from mpt.estimate import example_input
from mpt.pipeline.split import ordered_blocks

MODEL_ERRORS = (RuntimeError, IndexError, ValueError)
"""What a model's forward raises where it refuses its input (a wrong shape, batch norm's one
sample)."""
FREE = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default}
"""Ops that move no bytes though torch does not mark them as views."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One op of a forward or backward."""

    flops: float
    """Floating-point operations (matmuls and convolutions; 0 for the rest)."""
    bytes: float
    """Bytes of its tensor arguments and results."""
    split: bool = False
    """Whether it runs on 1/T of the features under tensor parallelism: inside a module the
    plan splits, or between a colwise module and the rowwise one that sums its result."""
    shape: tuple[int, int, int] | None = None
    """A matmul's (rows, inner, columns), each of its batch's matmuls, or a convolution's
    GEMM in its im2col form; None for other ops (attention kernels among them): a short
    dimension runs far below the peak."""
    results: tuple[int, ...] = ()
    """Bytes of each tensor it returns in new memory (none for an in-place or ``out=`` op)."""
    weighted: bool = False
    """Whether it takes a weight and an input that needs a gradient (a Linear's addmm, a
    convolution, a norm): where the paths to the weights leave the input's. torch's
    zero-bubble input backward (``stage_backward_input``'s param groups) keeps the gradient
    of its output for the weights' backward."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockCost:
    """One block (what a pipeline stage is made of) for one micro-batch."""

    name: str
    """The block's name in the model (``blocks.3``), or ``model`` for an unsplittable one."""
    forward: tuple[Op, ...]
    """The forward's ops, in order."""
    backward: tuple[Op, ...]
    """The backward's ops (input and weight gradients); split in the forward's proportion."""
    activations: int
    """Bytes autograd saves for the backward (as ``mpt.estimate.activation_bytes`` counts)."""
    shared_input: int
    """Bytes of the block's input that the previous block saves too (as its output: a ReLU's
    result that the next Linear saves as its input): one tensor, where both share a stage.
    For the first block, the batch's that it saves (a Linear's input): the script holds that
    tensor anyway."""
    output_bytes: int
    """Bytes of the block's output: what a pipeline sends to the next stage, and the size of
    its gradient coming back."""
    tp_forward_bytes: int
    """Bytes the forward sums over tp ranks: the outputs of the plan's ``rowwise`` modules."""
    tp_backward_bytes: int
    """Bytes the backward sums over tp ranks: the input gradients of ``colwise`` modules."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A model at one micro-batch size: every block's cost, in forward order."""

    micro_batch: int
    """Samples per forward."""
    blocks: tuple[BlockCost, ...]
    """The blocks' costs, in forward order."""
    input_bytes: int
    """Bytes of the micro-batch's input (the data)."""
    splittable: bool
    """Whether the model can be cut into pipeline stages (``ordered_blocks`` found blocks)."""


FUSED_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention,
                   torch.ops.aten._scaled_dot_product_flash_attention_backward,
                   torch.ops.aten._scaled_dot_product_efficient_attention,
                   torch.ops.aten._scaled_dot_product_efficient_attention_backward,
                   torch.ops.aten._scaled_dot_product_cudnn_attention,
                   torch.ops.aten._scaled_dot_product_cudnn_attention_backward}
"""Attention kernels that compute only the unmasked blocks of a causal mask (FlashAttention and
its kin): half the scores of a long sequence."""

MATMULS = {torch.ops.aten.mm: 0, torch.ops.aten.addmm: 1, torch.ops.aten.bmm: 0,
           torch.ops.aten.baddbmm: 1}
"""Matmul ops, by the position of their first factor among the arguments."""


Shape = tuple[int, int, int]
CONVOLUTION = ("stride", "padding", "dilation", "transposed", "groups")
"""The arguments of a convolution (and of its backward) that shape its GEMMs."""


def matmul_shapes(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Shape | None]:
    """The (rows, inner, columns) of each matmul an op's call runs, in equal shares of its
    FLOPs: one for a matmul; for a convolution, the GEMM of its im2col form (a forward, or each
    gradient its backward computes); ``[None]`` for any other op."""
    packet = func.overloadpacket
    if packet in MATMULS:
        first, second = args[MATMULS[packet]], args[MATMULS[packet] + 1]
        return [(int(first.shape[-2]), int(first.shape[-1]), int(second.shape[-1]))]
    if packet not in (torch.ops.aten.convolution, torch.ops.aten.convolution_backward):
        return [None]
    shaping = [_argument(func, args, kwargs, name) for name in CONVOLUTION]
    if packet is torch.ops.aten.convolution:  # (input, weight, ...)
        return [_conv_gemms(args[0], args[1], *shaping)["output"]]
    gemms = _conv_gemms(args[1], args[2], *shaping)  # (grad_output, input, weight, ...)
    mask = _argument(func, args, kwargs, "output_mask")  # input, weight, bias
    wanted = [name for name, on in zip(("input", "weight"), mask[:2], strict=True) if on]
    return [gemms[name] for name in wanted] or [None]


def _conv_gemms(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                groups: int) -> dict[str, Shape]:
    """A convolution's forward (``output``) and gradients (``input``, ``weight``) as the GEMMs
    of its im2col form, per group. A transposed convolution is the input gradient of the
    ordinary one from its output to its input, so its forward and input gradient swap."""
    kernel = weight.shape[2:]
    # the ordinary convolution's kernel slides over its output: a transposed one's input
    slides = x.shape[2:] if transposed else [
        (size + 2 * pad - dil * (k - 1) - 1) // step + 1 for size, pad, dil, k, step
        in zip(x.shape[2:], padding, dilation, kernel, stride, strict=True)]
    patch, out = weight.shape[1] * math.prod(kernel), weight.shape[0] // groups
    rows = int(x.shape[0] * math.prod(slides))
    forward, backward = (rows, int(patch), int(out)), (rows, int(out), int(patch))
    return {"output": backward if transposed else forward,
            "input": forward if transposed else backward,
            "weight": (int(out), rows, int(patch))}


def _argument(func: Any, args: Any, kwargs: dict[str, Any], name: str) -> Any:
    """The value an op was called with for its argument ``name`` (by its schema), or its
    default; None where the op has no such argument."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[index] if index < len(args) else argument.default_value
    return None


class _Recorder(TorchDispatchMode):
    """Records each op's FLOPs and bytes; ``split`` is set while a planned module runs.
    ``weights``: the ids of the block's parameters."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.split = False
        self.weights = weights

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func in FREE:
            return out
        packet = func.overloadpacket
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) \
            if packet in flop_registry else 0.0
        if packet in FUSED_ATTENTION and _argument(func, args, kwargs, "is_causal"):
            # torch's formula counts every score; a fused kernel skips the masked half.
            flops /= 2
        moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor))
        # an in-place or out= op returns memory it was given: nothing new to write first
        results = () if any(r.alias_info is not None for r in func._schema.returns) else tuple(
            t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        shapes = matmul_shapes(func, args, kwargs)
        weighted = self._weighted(args, kwargs)
        self.ops.extend(Op(flops=flops / len(shapes), bytes=moved / len(shapes), split=self.split,
                           shape=shape, results=results if index == 0 else (),
                           weighted=weighted and index == 0)
                        for index, shape in enumerate(shapes))
        return out

    def _weighted(self, args: Any, kwargs: dict[str, Any]) -> bool:
        """Whether the op's arguments hold a weight (or a view of one: a Linear's ``t()``)
        and a tensor, not a weight, that needs a gradient."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        weight = [id(t if t._base is None else t._base) in self.weights for t in tensors]
        return any(weight) and any(t.requires_grad and not w
                                   for t, w in zip(tensors, weight, strict=True))


def refusal(exc: BaseException) -> str:
    """A model's refusal (one of ``MODEL_ERRORS``) in one line: its message's first, or its
    type where it says nothing."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def style_of(entry: Any) -> str:
    """``colwise``, ``rowwise`` or another style's name, for a tensor_parallel_plan() value."""
    if isinstance(entry, str):
        return entry
    style = getattr(entry, "style", None)
    if isinstance(style, str):
        return style
    name = type(entry).__name__.lower()
    return next((s for s in ("colwise", "rowwise") if s in name), name)


def tp_plan_of(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan as module name -> style; empty where it has none."""
    plan = getattr(model, "tensor_parallel_plan", None)
    return {name: style_of(entry) for name, entry in plan().items()} if callable(plan) else {}


def blocks_of(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], bool]:
    """The model's blocks in forward order, and whether it can be cut between them; a model
    that follows no pipeline convention is one block."""
    try:
        return ordered_blocks(model), True
    except UsageError:
        return [("model", model)], False


def profile(model: nn.Module, input_shape: Sequence[int], input_dtype: torch.dtype,
            micro_batch: int) -> Workload:
    """Every block's cost for a micro-batch of ``micro_batch`` samples of ``input_shape``."""
    blocks, splittable = blocks_of(model)
    plan = tp_plan_of(model)
    x = example_input([micro_batch, *input_shape], input_dtype)
    data = x.numel() * x.element_size()
    costs = []
    kept = True  # whether the previous block saved its output: the batch is held anyway
    for index, (name, block) in enumerate(blocks):
        # The data needs no gradient; every later block's input does (its backward makes it).
        cost, x, kept = _block_cost(model, name, block, x, plan, input_grad=index > 0,
                                    previous_kept=kept)
        costs.append(cost)
    return Workload(micro_batch=micro_batch, blocks=tuple(costs), splittable=splittable,
                    input_bytes=data)


def _block_cost(model: nn.Module, name: str, block: nn.Module, x: torch.Tensor,
                plan: dict[str, str], *, input_grad: bool, previous_kept: bool
                ) -> tuple[BlockCost, torch.Tensor, bool]:
    """One block's records, its output (the next block's input, detached), and whether the
    block saves its output for its backward."""
    recorder = _Recorder({id(p) for p in block.parameters()})
    sums = {"rowwise": 0, "colwise": 0}
    handles = _mark_planned(model, block, plan, recorder, sums)
    if input_grad and x.is_floating_point():
        x = x.detach().requires_grad_(True)
    # the backward's gradients are dropped after it: left, the next profile of the model (at
    # another micro-batch size) would record an accumulation into each of them
    grads = [(p, p.grad) for p in block.parameters()]
    try:
        with recorder:
            out = block(x)
        forward = tuple(recorder.ops)
        recorder.ops.clear()
        # a first block without weights (a Flatten) has no backward: its input needs none
        if out.requires_grad:
            with recorder:
                out.backward(torch.empty_like(out))
        backward = tuple(recorder.ops)
    finally:
        for handle in handles:
            handle.remove()
        for parameter, grad in grads:
            parameter.grad = grad
    saved, input_kept, output_kept = _saved(block, x)
    size = x.numel() * x.element_size()
    cost = BlockCost(name=name, forward=forward, backward=backward, activations=saved,
                     shared_input=size if previous_kept and input_kept else 0,
                     output_bytes=out.numel() * out.element_size(),
                     tp_forward_bytes=sums["rowwise"], tp_backward_bytes=sums["colwise"])
    return cost, out.detach(), output_kept


def _saved(block: nn.Module, x: torch.Tensor) -> tuple[int, bool, bool]:
    """Bytes autograd saves in one forward of ``block`` (its weights, and views of them, are
    not activations), and whether its input and its output are among them."""
    parameters = {id(p) for p in block.parameters()}
    saved: dict[int, int] = {}
    roots: set[int] = set()  # the saved tensors, and the tensors they are views of

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in parameters:
            saved[id(tensor)] = tensor.numel() * tensor.element_size()
            roots.update((id(tensor), id(base)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = block(x)  # alive until the ids are read: they stay unique
        found = sum(saved.values()), id(x) in roots, id(out) in roots
    return found


def _mark_planned(model: nn.Module, block: nn.Module, plan: dict[str, str],
                  recorder: _Recorder, sums: dict[str, int]) -> list[Any]:
    """Forward hooks on the block's planned modules: mark their ops split, add up what the
    tp ranks sum (a rowwise module's output, a colwise module's input)."""
    names = {id(module): name for name, module in model.named_modules()}
    handles = []
    for module in block.modules():
        style = plan.get(names.get(id(module), ""))
        if style is None:
            continue

        def enter(_m: nn.Module, args: tuple[Any, ...]) -> None:
            recorder.split = True

        def leave(_m: nn.Module, args: tuple[Any, ...], out: Any, style: str = style) -> None:
            # A colwise output stays split (attention's heads, the MLP's hidden features)
            # until a rowwise module sums it: the ops between run on 1/T of the features.
            recorder.split = style == "colwise"
            if style == "rowwise":
                sums["rowwise"] += out.numel() * out.element_size()
            elif style == "colwise":
                sums["colwise"] += args[0].numel() * args[0].element_size()

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles
