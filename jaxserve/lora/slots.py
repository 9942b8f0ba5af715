"""Which adapters sit in the device's slots (an LRU of ``max_loras``), backed by a host cache of read
adapters (an LRU of ``max_cpu_loras``).

The device arrays (models/lora.py's layout: ``N = max_loras`` slots, numbered 1..N; 0 means "no adapter")
are arguments of the jitted step, never constants: writing an adapter into a slot is one small jitted
update (compiled once; the arrays are donated, so it writes in place) and no step recompiles; the step that
first uses an adapter pays its host-to-device copy. The scheduler never puts more than ``max_loras``
distinct adapters in one step, so ``prepare`` always finds room by evicting adapters the step does not use.

Adapters never stall requests that do not use them: ``add`` (when a request naming the adapter is queued)
checks it from its config and the weight file's header, then reads the tensors in a background thread; the
scheduler schedules the adapter's requests only once ``is_ready`` (the others keep stepping meanwhile).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import sharding
from jaxserve.lora.peft_loader import LoRAAdapter, check_adapter, load_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.models.lora import fold, layout_leaves

logger = logging.getLogger("jaxserve")


def _write_slot(
    arrays: list[jax.Array], slot: jax.Array, new: list[jax.Array], is_a: tuple[bool, ...], num_slots: int
) -> list[jax.Array]:
    """Put one adapter's arrays into ``slot``: A [in, N, P, R] along axis 1, B [N, P, R, *out] along axis 0; a
    folded WA [in, out + N*P*R] (models/lora.py) gets the new A [in, P, R] as its slot's P*R columns."""
    out = []
    for a, n, a_axis in zip(arrays, new, is_a):
        if a_axis and a.ndim == 2:
            pr = n.shape[1] * n.shape[2]
            start = a.shape[1] - (num_slots - slot) * pr  # the slots' columns follow the base's
            out.append(jax.lax.dynamic_update_slice(a, n.reshape(n.shape[0], pr).astype(a.dtype), (0, start)))
        else:
            out.append(a.at[:, slot].set(n) if a_axis else a.at[slot].set(n))
    return out


def _fold_all(kernels: list, shapes: list[tuple], out_sharding) -> list[jax.Array]:
    """Each base kernel [in, *out] with zero slots beside it: WA [in, out + N*P*R] (``models.lora.fold``). The
    list is emptied as it goes, so each kernel is freed once folded (when the caller holds no other reference):
    the peak is one kernel more, not the base weights twice."""
    fold_one = jax.jit(lambda w, a_shape: fold(w, jnp.zeros(a_shape, w.dtype)), static_argnums=1, out_shardings=out_sharding)
    out = []
    for shape in shapes:
        out.append(fold_one(kernels.pop(0), tuple(shape)))
        jax.block_until_ready(out[-1])
    return out


class LoRASlots:
    """Device slots and host cache of LoRA adapters for one ModelRunner (one replica)."""

    def __init__(self, lora_config, text_config, mesh: jax.sharding.Mesh, base_kernels: list[jax.Array] | None = None) -> None:
        """``base_kernels``: one base kernel per (layer, group) in ``layout_leaves`` order, to fold each group's A
        into (``models.lora.fold``): the caller then drops its own references to them, so that the base
        weights live only inside the folded arrays. Only on a one-device mesh, with the kernels in lora_dtype."""
        self.config = lora_config
        self.text_config = text_config
        self.num_slots = lora_config.max_loras  # array slots; a token's slot k (1..N) is index k - 1
        self.dtype = jnp.dtype(lora_config.lora_dtype)
        leaves = layout_leaves(text_config, self.num_slots, lora_config.max_lora_rank, text_config.num_hidden_layers)
        self.is_a = tuple(kind == "A" for _, _, kind, _, _ in leaves)
        shardings = [sharding.logical_sharding(mesh, axes, shape) for *_, shape, axes in leaves]
        new_shardings = [
            sharding.logical_sharding(mesh, axes[:1] + axes[2:] if a else axes[1:], shape[:1] + shape[2:] if a else shape[1:])
            for (*_, shape, axes), a in zip(leaves, self.is_a)
        ]
        self.folded = base_kernels is not None
        if self.folded:
            if mesh.size != 1:
                raise ValueError(f"folding LoRA A into the base kernels needs a one-device mesh, got {mesh.size} devices")
            shardings = [sharding.replicated(mesh) if a else s for s, a in zip(shardings, self.is_a)]
            folded = iter(_fold_all(base_kernels, [shape for (*_, shape, _), a in zip(leaves, self.is_a) if a], sharding.replicated(mesh)))
            self.arrays = [
                next(folded) if a else jax.device_put(np.zeros(shape, self.dtype), s)
                for (*_, shape, _), s, a in zip(leaves, shardings, self.is_a)
            ]
        else:
            self.arrays = [jax.device_put(np.zeros(shape, self.dtype), s) for (*_, shape, _), s in zip(leaves, shardings)]
        self.shardings = shardings
        self._leaves = leaves
        self._folded_a = tuple(a and self.folded for a in self.is_a)
        self._write = jax.jit(
            lambda arrays, slot, new: _write_slot(arrays, slot, new, self.is_a, self.num_slots),
            donate_argnums=0,
            in_shardings=(shardings, sharding.replicated(mesh), new_shardings),
            out_shardings=shardings,
        )
        self.requests: dict[int, LoRARequest] = {}  # lora_int_id -> the request that named it first
        self.host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()  # LRU, max_cpu_loras
        self.reading: dict[int, concurrent.futures.Future] = {}  # lora_int_id -> its tensors being read
        self.failed: dict[int, Exception] = {}  # adapters whose read failed: the engine aborts their requests
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-lora-read")
        self.resident: collections.OrderedDict[int, int] = collections.OrderedDict()  # lora_int_id -> slot, LRU
        self.free_slots = list(range(1, self.num_slots + 1))
        self.num_slot_writes = 0

    @property
    def nbytes(self) -> int:
        """The adapters' bytes (a folded array's base kernel columns are the model's, not counted here)."""
        pr = [math.prod(s[2:]) * self.num_slots * self.dtype.itemsize for (*_, s, _) in self._leaves]
        return sum(a.shape[0] * n if folded_a else a.nbytes for a, n, folded_a in zip(self.arrays, pr, self._folded_a))

    # ---- host side ----

    def add(self, request: LoRARequest) -> None:
        """Check the adapter against the model now (config and weight-file header: raises ValueError naming what
        is wrong) and start reading its tensors in the background, unless the host already has them."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(
                f"lora_int_id={request.lora_int_id} is already {known.lora_name!r} ({known.lora_path}); give "
                f"{request.lora_name!r} another id"
            )
        if known is None:
            check_adapter(request.lora_path, self.text_config, self.config.max_lora_rank)
            self.requests[request.lora_int_id] = request
        self._start_read(request)

    def is_ready(self, request: LoRARequest) -> bool:
        """Whether the adapter's tensors are on the host, so a step may use it (the scheduler asks before it
        schedules a request of this adapter; requests of other adapters carry on while it is read)."""
        lora_id = request.lora_int_id
        if lora_id in self.host or lora_id in self.resident:
            return True
        if lora_id in self.failed:
            return False
        future = self.reading.get(lora_id)
        if future is None:  # left the host cache while its requests waited: read it again
            self._start_read(request)
            return False
        if not future.done():
            return False
        del self.reading[lora_id]
        try:
            adapter = future.result()
        except Exception as e:  # noqa: BLE001 - passed the header check, then failed to read: its requests fail
            logger.error("LoRA adapter %r (%s) could not be read: %s", request.lora_name, request.lora_path, e)
            self.failed[lora_id] = e
            return False
        self._keep(lora_id, adapter)
        return True

    def wait_for_reads(self, timeout: float) -> None:
        """Block until some background read finishes (or ``timeout`` seconds); returns at once if none runs."""
        running = [f for f in self.reading.values() if not f.done()]
        if running:
            concurrent.futures.wait(running, timeout, concurrent.futures.FIRST_COMPLETED)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unload): host copy and slot. Returns whether it was known."""
        known = self.requests.pop(lora_int_id, None) is not None
        self.host.pop(lora_int_id, None)
        self.reading.pop(lora_int_id, None)
        self.failed.pop(lora_int_id, None)
        slot = self.resident.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)  # no token maps to it any more; the next load overwrites it
        return known

    def _start_read(self, request: LoRARequest) -> None:
        if request.lora_int_id in self.host:
            self.host.move_to_end(request.lora_int_id)
        elif request.lora_int_id not in self.reading:
            self.reading[request.lora_int_id] = self._reader.submit(self._read, request)

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        adapter = load_adapter(request.lora_path, self.text_config, self.config.max_lora_rank, self.dtype)
        adapter.name = request.lora_name
        return adapter

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Into the host cache, dropping the least recently used beyond max_cpu_loras (one still in a slot stays
        usable there; if it leaves its slot too, it is read again when next asked for)."""
        self.host[lora_id] = adapter
        while len(self.host) > self.config.max_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.info("LoRA adapter id %d left the host cache (max_cpu_loras=%d)", evicted, self.config.max_cpu_loras)

    # ---- device side ----

    def prepare(self, lora_requests: Sequence[Optional[LoRARequest]]) -> list[int]:
        """The slot of each sequence's adapter (0 for none), loading missing adapters into slots first."""
        needed = {r.lora_int_id: r for r in lora_requests if r is not None}
        if len(needed) > self.num_slots:
            raise RuntimeError(f"{len(needed)} adapters in one step, max_loras={self.num_slots}: a scheduler bug")
        for lora_id, request in needed.items():
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
                continue
            self._load(request, keep=needed)
        return [0 if r is None else self.resident[r.lora_int_id] for r in lora_requests]

    def _load(self, request: LoRARequest, keep: dict) -> None:
        adapter = self.host.get(request.lora_int_id)
        if adapter is None:  # not read yet (the scheduler checks is_ready, so this is rare): wait for it here
            self._start_read(request)
            future = self.reading.pop(request.lora_int_id, None)
            if future is not None:
                self._keep(request.lora_int_id, future.result())
            adapter = self.host[request.lora_int_id]
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next(i for i in self.resident if i not in keep)  # LRU first
            slot = self.resident.pop(victim)
        self.arrays = self._write(self.arrays, np.int32(slot - 1), adapter.arrays)
        self.resident[request.lora_int_id] = slot
        self.num_slot_writes += 1
