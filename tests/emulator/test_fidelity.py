"""Emulator behaviours found by running published hardware kernels, each checked against the documented behaviour.

* ``nl.NKIObject`` subclasses get a generated ``__init__`` (NKI language guide, "Class Support": "the compiler will
  create the initializer functions __init__ and __post_init__, if they are not provided by the user").
* ``nl.ndarray(..., address=(partition_offset, free_offset))`` places a buffer at that byte offset
  (``nki.language.ndarray`` page); buffers placed on the same bytes share them, so reusing PSUM banks on purpose is
  not over capacity.
* ``nisa.dma_transpose`` permutes a 3-D source by [2, 1, 0] and a 4-D source by [3, 1, 2, 0] (``nki.isa.dma_transpose``
  page), not as a flattened 2-D transpose.
* ``nisa.dma_copy`` with a runtime ``scalar_offset`` checks bounds when it runs and skips the access under
  ``oob_mode.skip`` (``nki.isa.dma_copy`` and ``nki.isa.oob_mode`` pages).
"""

from dataclasses import dataclass

import numpy as np
import pytest

from optimum_qwen35.kernels.emulator import NkiRuleError, nki, runtime, tensors

nl, nisa = nki.language, nki.isa
rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def fresh_context():
    with runtime.use(runtime.Context("trn2")) as ctx:
        yield ctx


# ------------------------------------------------------------------------------------------------ NKIObject
class GuideExample(nl.NKIObject):
    """The language guide's class C, without @dataclass ("The @dataclass decorator is optional")."""

    x: int
    y: bool = False

    def toggle(self):
        self.y = not self.y


def test_nkiobject_generated_init_from_annotations():
    c = GuideExample(1)
    c.toggle()
    assert (c.x, c.y) == (1, True)
    # "def __init__(self, x = None, y = False)": a field without a default gets None.
    d = GuideExample()
    assert (d.x, d.y) == (None, False)
    assert GuideExample(y=True, x=3).x == 3


def test_nkiobject_generated_init_without_annotations():
    class Tiling(nl.NKIObject):
        rows = 128
        cols = 512
        names = []

        def area(self):
            return self.rows * self.cols

        @property
        def half(self):
            return self.cols // 2

    t = Tiling(64)
    assert (t.rows, t.cols, t.area(), t.half) == (64, 512, 64 * 512, 256)
    u = Tiling(cols=8)
    assert (u.rows, u.cols) == (128, 8)
    u.names.append("a")
    assert Tiling().names == []  # a mutable default is not shared between instances


def test_nkiobject_post_init_and_user_init_and_dataclass():
    class WithPost(nl.NKIObject):
        n: int = 2

        def __post_init__(self):
            self.twice = 2 * self.n

    assert WithPost(5).twice == 10

    class UserInit(nl.NKIObject):  # the guide's class A: a user-provided __init__ is kept
        x: int = 1

        def __init__(self, x):
            self.x = x + 100

    assert UserInit(1).x == 101

    @dataclass
    class Decorated(nl.NKIObject):
        a: int
        b: int = 7

    assert (Decorated(1).a, Decorated(1).b) == (1, 7)
    with pytest.raises(TypeError):
        GuideExample(1, True, 3)


def test_dataclass_nkiobject_with_unannotated_fields_takes_its_fields():
    """`@dataclass` on an NKIObject whose fields are plain class attributes (the NKI Library's attention_cte has
    `SectionParams`, `AttnInternalBuffers`): Python's generated `__init__` would take no arguments; in NKI the class
    behaves as without the decorator ("@dataclass is optional"), taking its fields in order."""

    @dataclass
    class Section(nl.NKIObject):
        index = None  # no annotations: dataclasses sees no field
        offset = 0
        names = []

    s = Section(3, offset=128)
    assert (s.index, s.offset) == (3, 128)
    assert (Section().index, Section().offset) == (None, 0)
    Section().names.append("x")
    assert Section().names == []

    @dataclass
    class Mixed(nl.NKIObject):  # annotated fields first, then the plain ones, as the guide's generated __init__
        a: int = 1
        b: int = None
        c = 5

        def __post_init__(self):
            self.total = self.a + (self.b or 0) + self.c

    m = Mixed(2, 3, 4)
    assert (m.a, m.b, m.c, m.total) == (2, 3, 4, 9)
    assert Mixed(c=10).total == 11
    assert m == Mixed(2, 3, 4) and "Mixed(a=2, b=3)" in repr(m)  # the rest of what @dataclass adds is kept

    class Hand(nl.NKIObject):
        x = 1

    def init(self, x):  # an __init__ assigned by hand (not generated) replaces NKI's, as for any class
        self.x = -x

    Hand.__init__ = init
    assert Hand(4).x == -4


# ------------------------------------------------------------------------------------------------ address=
def test_explicit_address_reuse_is_not_over_capacity(fresh_context):
    # 8 PSUM banks of 2 KiB per partition. Two sets of 8 full-bank tiles placed on the same banks (a kernel that
    # reuses the banks on purpose) occupy 16 KiB, not 32 KiB.
    bank = 2048
    first = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, i * bank)) for i in range(8)]
    second = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, i * bank)) for i in range(8)]
    assert fresh_context.memory.used("psum") == 16 * 1024
    # Without addresses the same 16 tiles do not fit.
    del first, second
    auto = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]
    with pytest.raises(NkiRuleError, match=r"\[psum-capacity\]"):
        nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    del auto


def test_explicit_address_accounted_where_placed(fresh_context):
    a = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, address=(0, 0))  # bytes [0, 4096)
    b = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, address=(0, 2048))  # [2048, 6144): overlaps a by half
    assert fresh_context.memory.used("sbuf") == 6144
    c = nl.ndarray((128, 256), nl.float32, buffer=nl.sbuf)  # placed by the allocator: adds its own 1 KiB
    assert fresh_context.memory.used("sbuf") == 6144 + 1024
    del b
    assert fresh_context.memory.used("sbuf") == 4096 + 1024
    # A placement past the end of the partition is an error.
    with pytest.raises(NkiRuleError, match=r"\[out-of-bounds\]"):
        nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 15 * 1024))
    del a, c


# ------------------------------------------------------------------------------------------------ dma_transpose
def _hbm(x):
    return tensors.from_array(np.ascontiguousarray(x))


def test_dma_transpose_2d():
    x = rng.standard_normal((32, 48)).astype(np.float32)
    dst = nl.ndarray((48, 32), nl.float32, buffer=nl.sbuf)
    nisa.dma_transpose(dst=dst, src=_hbm(x))
    np.testing.assert_array_equal(dst.read(), x.T)


def test_dma_transpose_3d_permutes_2_1_0():
    x = rng.standard_normal((4, 8, 16)).astype(np.float32)
    dst = nl.ndarray((16, 8, 4), nl.float32, buffer=nl.sbuf)
    nisa.dma_transpose(dst=dst, src=_hbm(x))
    np.testing.assert_array_equal(dst.read(), np.transpose(x, (2, 1, 0)))
    # Not a flattened 2-D transpose of the [4, 128] view.
    assert not np.array_equal(dst.read().reshape(-1), x.reshape(4, -1).T.reshape(-1))


def test_dma_transpose_4d_permutes_3_1_2_0():
    x = rng.standard_normal((2, 3, 5, 16)).astype(np.float32)
    dst = nl.ndarray((16, 3, 5, 2), nl.float32, buffer=nl.sbuf)
    nisa.dma_transpose(dst=dst, src=_hbm(x), axes=(3, 1, 2, 0))
    np.testing.assert_array_equal(dst.read(), np.transpose(x, (3, 1, 2, 0)))
    with pytest.raises(NkiRuleError, match=r"\[shape\]"):
        nisa.dma_transpose(dst=dst, src=_hbm(x), axes=(3, 2, 1, 0))


# ------------------------------------------------------------------------------------------------ oob_mode
def test_runtime_scalar_offset_out_of_bounds_skips_or_raises():
    table = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    hbm = _hbm(table)
    index = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    row = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
    index.write(np.array([[2]]))
    nisa.dma_copy(dst=row, src=hbm.ap([[8, 1], [1, 8]], scalar_offset=index, indirect_dim=0))
    np.testing.assert_array_equal(row.read(), table[2:3])
    index.write(np.array([[-1]]))
    view = hbm.ap([[8, 1], [1, 8]], scalar_offset=index, indirect_dim=0)
    with pytest.raises(NkiRuleError, match=r"\[out-of-bounds\]"):
        nisa.dma_copy(dst=row, src=view)
    # Skipped: the destination keeps what it held.
    nisa.dma_copy(dst=view, src=row, oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(table, np.arange(32, dtype=np.float32).reshape(4, 8))
