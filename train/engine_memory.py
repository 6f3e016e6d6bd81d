"""What a DeepSpeed engine holds for its parameters, counted from its own tensors: the check of
the memory model's bytes per parameter (``vlmshard.model_sizes.bytes_per_param``).

Every tensor reachable from the engine (its module, the DeepSpeed optimizer wrapping torch's
AdamW, that optimizer's ``state``, flat buffers, ZeRO's partitions and buckets) is found by
walking attributes, lists, tuples and dicts (bounded depth, each object once) and counted once
per storage, so views into a flat buffer and the parameters pointing into it are not counted
twice. Storages fall into:

- ``weights``: the storages of the trained parameters (ZeRO-3: their partitions, ``ds_tensor``);
- ``gradients``: what holds gradients: the parameters' ``.grad`` and DeepSpeed's gradient
  attributes on them (``grad_accum``, ``_hp_grad``: the fp32 accumulation buffer), and the
  master partitions' ``.grad``;
- ``optimizer``: every other storage the optimizer reaches: fp32 master weights, Adam's moments,
  flat and partitioned buffers;
- ``buckets`` (not in ``total``): ZeRO's reduce buckets (``ipg_buckets``), of a fixed size
  (``reduce_bucket_size`` elements), not per parameter: ZeRO-3 keeps one for the whole run;
- ``frozen`` (not in ``total``): the weights the recipe leaves frozen (``vlmshard.recipe``),
  their storage alone (``model_sizes.weight_bytes_per_param`` each);
- ``other`` (not in ``total``): the rest the engine reaches: module buffers, the pipeline
  engine's send and receive buffers (micro-batch sized: the activations' part of the memory
  model, not the parameters').

``total`` is what grows with the parameters: ``model_sizes.bytes_per_param`` times ``params``.
"""

from __future__ import annotations

import types

# DeepSpeed's attributes on a parameter that hold gradients (stage_1_and_2's grad_accum,
# BF16_Optimizer's _hp_grad), and those that hold its ZeRO-3 partition.
_GRAD_ATTRS = ("grad", "grad_accum", "_hp_grad")
_PARTITION_ATTRS = ("ds_tensor",)
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, range)


def _storage(tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for one without memory (meta, empty)."""
    if tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
        return None
    if storage.nbytes() == 0:
        return None
    return (tensor.device.type, tensor.device.index, storage.data_ptr()), storage.nbytes()


def _grads_of(tensor) -> list:
    return [g for g in (getattr(tensor, a, None) for a in _GRAD_ATTRS) if g is not None]


class _Walk:
    """Storages reachable from roots, each credited to the first category that reaches it."""

    def __init__(self, depth: int) -> None:
        import torch

        self.torch = torch
        self.depth = depth
        self.seen: set[int] = set()
        self.storages: dict = {}  # key -> (bytes, category)

    def add(self, tensor, category: str) -> None:
        found = _storage(tensor)
        if found and found[0] not in self.storages:
            self.storages[found[0]] = (found[1], category)

    def walk(self, obj, category: str, depth: int | None = None) -> None:
        depth = self.depth if depth is None else depth
        stack = [(obj, depth)]
        while stack:
            obj, left = stack.pop()
            if isinstance(obj, _LEAVES) or id(obj) in self.seen:
                continue
            self.seen.add(id(obj))
            if isinstance(obj, self.torch.Tensor):
                self.add(obj, category)
                children = list(getattr(obj, "__dict__", {}).values())  # a Parameter's attributes
            elif isinstance(obj, dict):
                children = [*obj.keys(), *obj.values()]
            elif isinstance(obj, (list, tuple, set, frozenset)):
                children = list(obj)
            elif hasattr(obj, "__dict__"):
                children = list(vars(obj).values())
            else:
                children = [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
            if left > 0:
                stack.extend((c, left - 1) for c in children)


def engine_bytes(engine, trained: list, depth: int = 12) -> dict:
    """Bytes of the storages ``engine`` holds for its trained parameters ``trained`` (this
    rank's), by category (see the module docstring), and ``params``: how many parameters this
    rank trains (ZeRO-3: the whole model's, as without it; its weights are partitions); and
    ``frozen``, the bytes of the weights the recipe leaves frozen, ``frozen_params`` of them."""
    import torch

    walk = _Walk(depth)
    module = getattr(engine, "module", None)
    frozen = [q for q in module.parameters() if not q.requires_grad] if module is not None \
        else []
    # the weights first (a ZeRO-3 parameter's own data is empty: its partition holds it); a
    # frozen weight's storage alone
    for params, category in ((trained, "weights"), (frozen, "frozen")):
        for p in params:
            walk.add(p, category)
            for attr in _PARTITION_ATTRS:
                part = getattr(p, attr, None)
                if isinstance(part, torch.Tensor):
                    walk.add(part, category)
    if module is not None:  # not the optimizer's, though a ZeRO optimizer reaches the module
        for tensor in module.buffers():
            walk.add(tensor, "other")
    optimizer = getattr(engine, "optimizer", None)
    masters = [q for group in getattr(optimizer, "param_groups", []) for q in group["params"]]
    basic = getattr(engine, "basic_optimizer", None)
    masters += [q for group in getattr(basic, "param_groups", []) for q in group["params"]]
    for p in [*trained, *masters]:
        for grad in _grads_of(p):
            walk.add(grad, "gradients")
    for root in (optimizer, basic):
        if root is not None:
            walk.walk(getattr(root, "ipg_buckets", None), "buckets")
            walk.walk(root, "optimizer")
    walk.walk(engine, "other")
    totals = {"weights": 0, "gradients": 0, "optimizer": 0, "buckets": 0, "other": 0,
              "frozen": 0}
    for nbytes, category in walk.storages.values():
        totals[category] += nbytes
    params = sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in trained)
    return {"weights": totals["weights"], "gradients": totals["gradients"],
            "optimizer": totals["optimizer"],
            "total": totals["weights"] + totals["gradients"] + totals["optimizer"],
            "params": params, "buckets": totals["buckets"], "other": totals["other"],
            "frozen": totals["frozen"],
            "frozen_params": sum(int(getattr(q, "ds_numel", 0) or q.numel()) for q in frozen)}


def on_first_step(optimizer, measure) -> None:
    """Call ``measure()`` once, right after torch's ``optimizer`` first steps: inside
    DeepSpeed's step, after the update and before it frees or zeroes the gradients, when
    weights, gradients, master weights and moments are all held (the step's peak of state)."""
    handle = None

    def hook(*_):
        handle.remove()
        measure()

    handle = optimizer.register_step_post_hook(hook)


class GatheredWeights:
    """The most bytes of ZeRO-3's split weights gathered whole at once in each of a run's first
    ``steps`` steps (what ``model_sizes.zero3_fixed_bytes`` charges as ``gathered``): sampled
    as every module's forward starts and ends (after DeepSpeed's own hooks gather or release)
    and as each weight's gradient lands. The first step traces DeepSpeed's module order and
    releases every weight after its use; the second runs as every later one. Then the hooks
    go: each sample walks every weight."""

    def __init__(self, module, steps: int = 2) -> None:
        self.split = [p for p in module.parameters() if not getattr(p, "ds_persist", False)]
        self.peak = 0
        self.left = steps
        self.handles = []
        for m in module.modules():
            self.handles += [m.register_forward_pre_hook(self.sample),
                             m.register_forward_hook(self.sample)]
        self.handles += [p.register_post_accumulate_grad_hook(self.sample)
                         for p in self.split if p.requires_grad]

    def sample(self, *_) -> None:
        # a split weight's own data is empty but where it is gathered
        self.peak = max(self.peak, sum(p.data.numel() * p.element_size() for p in self.split))

    def take(self) -> int | None:
        """The step's peak (and the next step starts afresh); None after the first ``steps``."""
        if not self.left:
            return None
        peak, self.peak, self.left = self.peak, 0, self.left - 1
        if not self.left:
            for handle in self.handles:
                handle.remove()
        return peak
