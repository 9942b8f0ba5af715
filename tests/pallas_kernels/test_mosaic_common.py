"""The version shims of ``mosaic_common`` take the branch each jax release needs. The kernels only run on a
Hopper GPU (and their interpret-mode tests take the interpreter's branch), so the GPU branches are checked
here against stand-ins shaped like each release's ``plgpu``."""

import types

from jaxserve.pallas_kernels import mosaic_common


class Ref:
    def __init__(self):
        self.stored = None

    def __setitem__(self, index, value):
        assert index is Ellipsis
        self.stored = value


def with_plgpu(monkeypatch, **api):
    monkeypatch.setattr(mosaic_common, "plgpu", lambda: types.SimpleNamespace(**api))


def test_load_passes_an_empty_index_only_where_it_is_required(monkeypatch):
    calls = []

    def load_010(ref, idx, *, layout=None):  # jax 0.10: the index is required
        calls.append(("0.10", idx))

    def load_011(ref, idx=None, *, layout=None):  # jax 0.11: deprecated, optional
        calls.append(("0.11", idx))

    def load_012(ref, *, layout=None):  # jax 0.12: gone
        calls.append(("0.12", None))

    for fn in (load_010, load_011, load_012):
        with_plgpu(monkeypatch, load=fn)
        mosaic_common.load("ref", layout="L")
    assert calls == [("0.10", ()), ("0.11", None), ("0.12", None)]


def test_store_unplanned_asks_jax_012_for_the_plain_transfer(monkeypatch):
    calls = []
    with_plgpu(monkeypatch, store=lambda ref, value, *, optimized=True: calls.append((ref, value, optimized)))
    ref = Ref()
    mosaic_common.store_unplanned(ref, "v", interpret=False)
    assert calls == [(ref, "v", False)] and ref.stored is None


def test_store_unplanned_assigns_before_jax_012_and_in_the_interpreter(monkeypatch):
    with_plgpu(monkeypatch)  # jax 0.10/0.11: no plgpu.store; the assignment stores unplanned
    ref = Ref()
    mosaic_common.store_unplanned(ref, "v", interpret=False)
    assert ref.stored == "v"

    def store(*args, **kwargs):
        raise AssertionError("plgpu.store called in the interpreter")

    with_plgpu(monkeypatch, store=store)
    ref = Ref()
    mosaic_common.store_unplanned(ref, "w", interpret=True)
    assert ref.stored == "w"
