"""The decode step of a rank's local layers for the batch, compiled (``BatchGenerator(compiled_decode=True)``).

Building a decode step's graph costs every tick the same Python and dispatch whatever the rows (issue #52: about
2-3 ms of a token outside the layers). :func:`mx.compile` replays a traced graph, but a trace is tied to its inputs'
shapes and to the Python values it saw, and mlx-lm's ``BatchKVCache`` changes both at every step: it returns its
keys sliced to ``_idx`` (a Python int that grows) and builds the mask from it.

:class:`CompiledDecode` keeps the batch caches mlx-lm's (every surgery the generator does on them, joins, ``filter``,
``extend``, ``extract``, :func:`~.rows.fill_rows`, stays mlx-lm's own code) and changes only how a decode step reads
them: each layer cache's keys and values are kept at a *room* that is a multiple of :data:`ROOM_STEP` positions
(padded with zeros after a surgery or when full), and the traced step writes the new position at ``_idx`` given as
an array, attends over the whole room with the positions before each row's left padding and after ``_idx`` masked
(:func:`room_mask`, mlx-lm's ``create_causal_mask`` for one query, widened), and returns the room whole. One trace
then serves every step until the rows or the room change (``mx.compile`` traces again for new shapes:
:attr:`CompiledDecode.traces` counts them).

Only the local layers are compiled, between the stage's receive and its send: during the step the model's layer
list is replaced by one :class:`FusedLayers` that receives, runs the compiled step and hands the output to the
stage as the last local layer does (:mod:`pipemlx.runtime.edges`), so the embedding, the head (whole, shared or
split) and the messages are the eager step's. A step the compiled path cannot hold runs eagerly, never fails: a
model whose inner loop is not the plain ``h = layer(h, mask, cache)`` over one mask (:data:`COMPILED_FAMILIES`), a
cache that is not a plain ``BatchKVCache`` (``max_kv_size``'s rotating ones, quantized ones, a lent heads' pair,
Mamba's arrays), an empty one, or layers whose caches hold different positions.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask  # pyright: ignore[reportUnknownVariableType]
from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache, make_prompt_cache  # pyright: ignore[reportUnknownVariableType]

from ..edges import ReceivingLayer, SendingLayer
from ..stage import PipelineStage

ROOM_STEP = 256
"""The keys and values of a compiled step's batch caches hold a multiple of this many positions (mlx-lm's
``BatchKVCache.step``): the room grows by it, and a trace serves every step within one room."""

COMPILED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""mlx-lm ``model_type`` s whose inner model runs its layers as ``h = layer(h, mask, cache)`` over one mask built
from the first cache, which :class:`FusedLayers` replays (a family with per-layer masks or more arguments, such as
gemma3's sliding layers, is left eager)."""

PROBE_LENGTHS = (3, 6)
"""The positions the two rows of :meth:`CompiledDecode.agrees` hold before its steps."""
PROBE_STEPS = 2
PROBE_TOLERANCE = 1e-4
"""How far the compiled step's output may be from the eager one's, relative to the largest (rounding, not a bug)."""


def room_mask(left_padding: mx.array, at: mx.array, room: int) -> mx.array:
    """The mask of one query per row at position ``at`` over a room of ``room`` positions, ``[rows, 1, 1, room]``:
    a row sees its positions from its left padding up to ``at`` (what mlx-lm's ``BatchKVCache.make_mask(1)`` gives
    over the first ``at + 1`` positions, the others masked)."""
    columns = mx.arange(room)[None, :]
    seen = (columns >= left_padding[:, None]) & (columns <= at)
    return seen[:, None, None, :]


class TracedBatchCache:
    """What a layer's attention asks of its cache inside the trace: ``offset`` (per row, for the rotary
    embedding) and ``update_and_fetch``, which writes the new position at ``at`` into the whole room."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, at: mx.array) -> None:
        self.keys, self.values, self.offset, self.at = keys, values, offset, at

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.at, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.at, axes=(2,))
        return self.keys, self.values


class TracedCacheList:
    """A layer's ``CacheList`` inside the trace (a lent heads' pair: :class:`pipemlx.models.lending.LentHeadsCache`):
    its parts by index, and the first one's answers, as that class gives them."""

    def __init__(self, parts: list[TracedBatchCache]) -> None:
        self.parts = parts

    def __getitem__(self, index: int) -> TracedBatchCache:
        return self.parts[index]

    @property
    def offset(self) -> mx.array:
        return self.parts[0].offset


def parts_of(cache: Any) -> list[Any]:
    """A layer cache's plain caches: a ``CacheList``'s parts, else the cache itself."""
    return list(cast(Any, cache).caches) if isinstance(cache, CacheList) else [cache]


def structure_of(caches: list[Any]) -> tuple[int, ...]:
    """Per layer cache, how many caches its ``CacheList`` holds (0: a plain cache)."""
    return tuple(len(parts_of(c)) if isinstance(c, CacheList) else 0 for c in caches)


def fit_room(cache: Any, room: int) -> None:
    """Give ``cache`` (a ``BatchKVCache``) keys and values of exactly ``room`` positions, its ``_idx`` first ones
    kept (what lies past them is never read: mlx-lm's own cache zero-fills its growth there too)."""
    held = cast(int, cache._idx)  # pyright: ignore[reportPrivateUsage]
    for name in ("keys", "values"):
        array = cast(mx.array, getattr(cache, name))
        if array.shape[2] == room:
            continue
        kept = array[..., :held, :]
        setattr(cache, name, mx.pad(kept, [(0, 0), (0, 0), (0, room - held), (0, 0)]))


def original_call(layer: nn.Module) -> Callable[..., mx.array]:
    """``layer``'s own ``__call__``, without the receive or send :func:`~pipemlx.runtime.edges.wrap_edge` added (a
    cut inside the layer, ``lend``, stays: it is the layer's computation)."""
    cls: type = type(layer)
    if issubclass(cls, (ReceivingLayer, SendingLayer)):
        cls = cls.__bases__[-1]
    call = cast(Callable[..., mx.array], cls.__call__)
    return lambda *args: call(layer, *args)


class CompiledDecode:
    """A rank's local layers' decode step over its batch caches, compiled (see the module).

    ``traces`` counts the traces made (one per distinct rows and room: :attr:`shapes`, the probe's included),
    ``steps`` the steps run compiled.
    """

    def __init__(self, model: nn.Module, stage: PipelineStage, owner: nn.Module, structure: tuple[int, ...]) -> None:
        self.stage = stage
        self.structure = structure  # per layer: the parts of its CacheList (0: a plain cache), as its caches are made
        self.owner = owner  # the module whose ``layers`` list the inner model runs
        self.calls = [original_call(layer) for layer in cast(list[nn.Module], cast(Any, model).layers)]
        self.traces = 0
        self.steps = 0
        self.shapes: set[tuple[int, int]] = set()  # the (rows, room) of every step run (the probe's too)
        self._compiled = mx.compile(self._trace)

    @classmethod
    def of(cls, model: nn.Module, stage: PipelineStage) -> CompiledDecode | None:
        """``model``'s compiled decode, or ``None`` where its inner loop is not one :class:`FusedLayers` replays."""
        kind = getattr(getattr(model, "args", None), "model_type", None)
        owner = getattr(model, "model", None)
        layers = getattr(model, "layers", None)
        if kind not in COMPILED_FAMILIES or not isinstance(owner, nn.Module) or not isinstance(layers, list):
            return None
        inner = cast(Any, owner).get("layers")
        if not isinstance(inner, list) or [id(x) for x in inner] != [id(x) for x in layers]:  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
            return None
        if getattr(owner, "swa_idx", None) is not None:  # llama with sliding layers: two masks
            return None
        caches = make_prompt_cache(model)
        if not caches or not all(type(p) is KVCache for c in caches for p in parts_of(c)):
            return None
        decode = cls(model, stage, owner, structure_of(caches))
        return decode if decode.agrees(lambda: make_prompt_cache(model)) else None

    def agrees(self, new_cache: Callable[[], list[Any]]) -> bool:
        """Whether the compiled step gives what the layers give eagerly over mlx-lm's ``BatchKVCache`` s (their own
        mask), made from ``new_cache()`` and merged as the batch's rows are: two rows of :data:`PROBE_LENGTHS`
        positions (left-padded), then :data:`PROBE_STEPS` steps, on the stage's compute stream; local work only.
        A layer that asks the cache what the traced one does not answer fails it: then every step is eager."""
        info = self.stage.info
        width = info.lending.incoming_width or info.hidden_size
        dtype = info.dtype or mx.float32
        try:
            with mx.stream(self.stage.compute_stream):  # where the steps run (a trace is made for a stream)
                agreed = self._agrees(new_cache, width, dtype)
        except Exception:  # a layer that asks the cache what the traced one does not answer: eager steps
            return False
        finally:
            self.steps = 0
        return agreed

    def _agrees(self, new_cache: Callable[[], list[Any]], width: int, dtype: mx.Dtype) -> bool:
        """:meth:`agrees`' runs, eager then compiled, on the current stream."""
        runs: list[list[mx.array]] = []
        for compiled in (False, True):
            rows: list[list[Any]] = []
            for i, length in enumerate(PROBE_LENGTHS):
                caches = new_cache()
                hidden = mx.random.normal((1, length, width), key=mx.random.key(i)).astype(dtype)
                mask: Any = create_attention_mask(hidden, caches[0])  # pyright: ignore[reportUnknownVariableType]
                for call, cache in zip(self.calls, caches):
                    hidden = call(hidden, mask, cache)
                rows.append(caches)
            # Each layer cache's own batch class, as the batch's rows merge them (KVCache -> BatchKVCache).
            batch = [rows[0][layer].merge([row[layer] for row in rows]) for layer in range(len(self.calls))]
            outputs: list[mx.array] = []
            for step in range(PROBE_STEPS):
                hidden = mx.random.normal((len(rows), 1, width), key=mx.random.key(10 + step)).astype(dtype)
                if compiled:
                    outputs.append(self.step(hidden, batch))
                else:
                    mask = batch[0].make_mask(1)
                    for call, cache in zip(self.calls, batch):
                        hidden = call(hidden, mask, cache)
                    outputs.append(hidden)
            runs.append(outputs)
        want, have = mx.concatenate(runs[0], axis=1), mx.concatenate(runs[1], axis=1)
        scale = max(1.0, cast(float, mx.max(mx.abs(want)).item()))
        return cast(float, mx.max(mx.abs(want - have)).item()) <= PROBE_TOLERANCE * scale

    def holds(self, caches: list[Any]) -> bool:
        """Whether a decode step over ``caches`` (this rank's batch caches) can run compiled: every layer's a plain
        ``BatchKVCache`` or a ``CacheList`` of them (a lent heads' pair), not empty, all holding the same positions."""
        if len(caches) != len(self.calls) or not caches or structure_of(caches) != self.structure:
            return False
        parts = [p for c in caches for p in parts_of(c)]
        if not all(type(p) is BatchKVCache and p.keys is not None for p in parts):  # pyright: ignore[reportUnknownMemberType]
            return False
        held = {p._idx for p in parts}  # pyright: ignore[reportPrivateUsage]
        return len(held) == 1

    def layers(self, caches: list[Any]) -> Any:
        """A context in which the model's forward runs its local layers' step compiled over ``caches``; a null
        context where it cannot (:meth:`holds`)."""
        if not self.holds(caches):
            return nullcontext()
        return self._swapped(caches)

    @contextmanager
    def _swapped(self, caches: list[Any]) -> Generator[None, None, None]:
        owner = cast(Any, self.owner)
        kept = owner["layers"]
        owner["layers"] = [FusedLayers(self, caches)]
        try:
            yield
        finally:
            owner["layers"] = kept

    def step(self, hidden: mx.array, caches: list[Any]) -> mx.array:
        """The local layers over ``hidden`` (``[rows, 1, width]``), each writing its position into its cache."""
        if hidden.shape[1] != 1:
            raise ValueError(f"a compiled decode step reads one position per row, got {hidden.shape[1]}")
        parts = [p for c in caches for p in parts_of(c)]
        held = cast(int, parts[0]._idx)  # pyright: ignore[reportPrivateUsage]
        room = -(-(held + 1) // ROOM_STEP) * ROOM_STEP
        for part in parts:
            fit_room(part, room)
        first = parts[0]
        self.shapes.add((hidden.shape[0], room))
        arrays = [cast(mx.array, a) for p in parts for a in (p.keys, p.values)]
        at = mx.array([held], dtype=mx.int32)
        output, *updated = self._compiled(hidden, at, first.left_padding, first.offset, *arrays)
        for i, part in enumerate(parts):
            part.keys, part.values = updated[2 * i], updated[2 * i + 1]
            part.offset = part.offset + 1
            part._idx = held + 1  # pyright: ignore[reportPrivateUsage]
        self.steps += 1
        return output

    def _trace(
        self,
        hidden: mx.array,
        at: mx.array,
        left_padding: mx.array,
        offset: mx.array,
        *arrays: mx.array,
    ) -> list[mx.array]:
        """The traced step over the caches' arrays, laid out as :attr:`structure` says."""
        self.traces += 1
        mask = room_mask(left_padding, at, arrays[0].shape[2])
        parts = [TracedBatchCache(arrays[2 * i], arrays[2 * i + 1], offset, at) for i in range(len(arrays) // 2)]
        layered: list[Any] = []
        for count in self.structure:
            if count:
                layered.append(TracedCacheList(parts[:count]))
                parts = parts[count:]
            else:
                layered.append(parts.pop(0))
        for call, cache in zip(self.calls, layered):
            hidden = call(hidden, mask, cache)
        traced = [p for c in layered for p in (c.parts if isinstance(c, TracedCacheList) else [c])]
        return [hidden, *(a for c in traced for a in (c.keys, c.values))]


class FusedLayers:
    """Stands in for the model's layer list during a compiled step: the first local layer's receive, the compiled
    step, the last local layer's hand-off to the stage (:mod:`pipemlx.runtime.edges`); the inner model's mask and
    caches are not read (the step has its own)."""

    use_sliding = False  # llama's loop asks each layer which mask it takes
    is_sliding = False

    def __init__(self, decode: CompiledDecode, caches: list[Any]) -> None:
        self.decode, self.caches = decode, caches

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        del mask, cache
        stage = self.decode.stage
        if stage.world_size > 1 and not stage.is_first:
            x = stage.receive(x)
        output = self.decode.step(x, self.caches)
        if stage.world_size > 1:
            output = stage.emit(output, None)
        return output
