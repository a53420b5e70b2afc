"""The blocked token layout of the layer kernels (iclab.ops._runtime.blocked): round trips, spare lanes zero."""

import numpy as np
import pytest

from iclab.ops._runtime import blocked as _blocked


@pytest.mark.parametrize("B", [1, _blocked.LANES, 2 * _blocked.LANES + 5])
def test_blocks_round_trip_with_zero_spare_lanes(B):
    rng = np.random.default_rng(B)
    Z = rng.standard_normal((B, 7, 3)).astype(np.float32)
    Zb = _blocked.to_blocks(Z, threads=2)
    nb = -(-B // _blocked.LANES)
    assert Zb.shape == (nb, 7, 3, _blocked.LANES)
    # prompt b of block i in lane b
    np.testing.assert_array_equal(Zb[B // _blocked.LANES - (B % _blocked.LANES == 0), :, :, (B - 1) % _blocked.LANES],
                                  Z[B - 1])
    flat = np.moveaxis(Zb, 3, 1).reshape(nb * _blocked.LANES, 7, 3)
    np.testing.assert_array_equal(flat[:B], Z)
    assert not flat[B:].any()
    np.testing.assert_array_equal(_blocked.from_blocks(Zb, B, threads=3), Z)
    v = rng.standard_normal((B, 4))
    lv = _blocked.lanes(v, nb)
    assert lv.shape == (nb, 4, _blocked.LANES) and not np.moveaxis(lv, 2, 1).reshape(-1, 4)[B:].any()
    np.testing.assert_array_equal(_blocked.unlanes(lv, B), v)


def test_blocks_of_chosen_token_positions():
    """to_blocks(Z, positions=p) is to_blocks(Z[:, p]) (the gated grids read each n̄'s tokens so); bad
    positions are refused."""
    rng = np.random.default_rng(3)
    Z = rng.standard_normal((_blocked.LANES + 3, 11, 4)).astype(np.float32)
    p = np.array([0, 3, 4, 10])
    np.testing.assert_array_equal(_blocked.to_blocks(Z, positions=p, threads=2), _blocked.to_blocks(Z[:, p]))
    for bad in (np.array([0, 11]), np.array([-1]), np.zeros((2, 2), np.int64)):
        with pytest.raises(ValueError, match="positions"):
            _blocked.to_blocks(Z, positions=bad)


def test_blocks_written_into_a_given_array():
    """to_blocks(..., out=a) fills a (every slot, spare lanes zeroed) and returns it; an out of another shape or
    dtype is refused."""
    rng = np.random.default_rng(4)
    Z = rng.standard_normal((_blocked.LANES + 3, 6, 4)).astype(np.float32)
    p = np.array([1, 2, 5])
    out = np.full((2, 3, 4, _blocked.LANES), np.nan, np.float32)
    assert _blocked.to_blocks(Z, positions=p, out=out) is out
    np.testing.assert_array_equal(out, _blocked.to_blocks(Z[:, p]))
    for bad in (np.empty((2, 6, 4, _blocked.LANES), np.float32), np.empty((2, 3, 4, _blocked.LANES)),
                np.empty((2, 3, 4, 2 * _blocked.LANES), np.float32)[..., ::2]):
        with pytest.raises(ValueError, match="out must be"):
            _blocked.to_blocks(Z, positions=p, out=bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_aligned_arrays_start_on_a_cache_line(dtype):
    """aligned_empty's arrays (the kernels' blocked arrays and scratch) start on ALIGN-byte boundaries whatever the
    heap hands out (many sizes, kept alive so that each comes from a fresh place), C-contiguous, of the shape and
    dtype asked; to_blocks and lanes return such arrays."""
    keep = []
    for n in range(1, 40):
        a = _blocked.aligned_empty((n, 3), dtype)
        assert a.ctypes.data % _blocked.ALIGN == 0
        assert a.shape == (n, 3) and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
        keep.append(a)
    assert _blocked.aligned_empty(5, dtype).shape == (5,)
    Z = np.ones((_blocked.LANES + 1, 4, 3), np.float32)
    for _ in range(8):
        keep += [_blocked.to_blocks(Z), _blocked.lanes(Z[:, 0], 2)]
        assert keep[-2].ctypes.data % _blocked.ALIGN == 0 and keep[-1].ctypes.data % _blocked.ALIGN == 0


@pytest.mark.parametrize("B, T, positions", [(2 * _blocked.LANES + 5, 9, None), (3 * _blocked.LANES, 20, [19, 0, 7, 7]),
                                             (_blocked.LANES, 1, None), (5, 4, [1, 3])])
def test_the_ir_transposition_moves_the_same_values(B, T, positions, monkeypatch):
    """float32 tokens of width LANES: the full blocks transposed in registers (``_take_ir_kernel``), the last partial
    block by the element-wise kernel; the same array as the element-wise kernel alone, at every position choice, on
    one thread and two, and every prompt in its lane."""
    rng = np.random.default_rng(T)
    Z = rng.standard_normal((B, T, _blocked.LANES)).astype(np.float32)
    P = None if positions is None else np.asarray(positions, np.int64)
    monkeypatch.setattr(_blocked, "IR_TAKE", False)
    ref = _blocked.to_blocks(Z, positions=P)
    monkeypatch.setattr(_blocked, "IR_TAKE", True)
    for threads in (1, 2):
        np.testing.assert_array_equal(_blocked.to_blocks(Z, positions=P, threads=threads), ref)
    take = Z if P is None else Z[:, P]
    flat = np.moveaxis(ref, 3, 1).reshape(-1, take.shape[1], _blocked.LANES)
    np.testing.assert_array_equal(flat[:B], take)
    assert not flat[B:].any()
