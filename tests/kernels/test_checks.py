"""Bad inputs raise a clear exception from every entry point, Triton launchers and references alike."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels.paged_inputs import make_paged_inputs  # noqa: E402

DECODE = [kernels.decode_attention, kernels.decode_attention_ref]
PREFILL = [kernels.prefill_attention, kernels.prefill_attention_ref]
WRITE = [kernels.write_kv, kernels.write_kv_ref]


def decode_inputs(**changes):
    inputs = make_paged_inputs([20, 33], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    return dataclasses.replace(inputs, **changes)


def prefill_inputs(**changes):
    inputs = make_paged_inputs([20, 33], [5, 33], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    return dataclasses.replace(inputs, **changes)


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


BAD = {
    "q float64": (TypeError, "q must have dtype", lambda i: dict(q=i.q.double())),
    "q dtype differs from cache": (TypeError, "KV cache holds", lambda i: dict(q=i.q.half())),
    "integer q": (TypeError, "q must have dtype", lambda i: dict(q=i.q.to(torch.int32))),
    "float block tables": (TypeError, "block_tables must have dtype",
                           lambda i: dict(block_tables=i.block_tables.float())),
    "q rank 2": (ValueError, "q must have rank 3", lambda i: dict(q=i.q.flatten(1))),
    "cache rank 3": (ValueError, "k_cache must have rank 4", lambda i: dict(k_cache=i.k_cache[0])),
    "context_lens rank 2": (ValueError, "context_lens must have rank 1",
                            lambda i: dict(context_lens=i.context_lens[None])),
    "q heads not a multiple of kv heads": (ValueError, "not a multiple", lambda i: dict(q=i.q[:, :3])),
    "head_dim mismatch": (ValueError, "head_dim", lambda i: dict(q=i.q[..., :32])),
    "k and v caches differ": (ValueError, "must match", lambda i: dict(v_cache=i.v_cache[:, :, :1])),
    "block table too short": (ValueError, "block table too short",
                              lambda i: dict(block_tables=i.block_tables[:, :2])),
    "context longer than table": (ValueError, "block table too short",
                                  lambda i: dict(context_lens=i.context_lens + 48)),
    "table rows != sequences": (ValueError, "sequences", lambda i: dict(block_tables=i.block_tables[:1])),
    "scale is a tensor": (TypeError, "scale", lambda i: dict(scale=torch.tensor(0.1))),
}


ATTENTION = [(fn, decode_inputs, "decode_args") for fn in DECODE] + [
    (fn, prefill_inputs, "prefill_args") for fn in PREFILL]


@pytest.mark.parametrize("fn,make,args", ATTENTION, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("case", sorted(BAD))
def test_attention_rejects(fn, make, args, case):
    error, message, change = BAD[case]
    inputs = make()
    with pytest.raises(error, match=message):
        fn(*getattr(dataclasses.replace(inputs, **change(inputs)), args)())


@pytest.mark.parametrize("fn", DECODE, ids=lambda f: f.__name__)
def test_decode_rejects_empty_context(fn):
    with pytest.raises(ValueError, match="context_lens must be >= 1"):
        fn(*decode_inputs(context_lens=int32([0, 33])).decode_args())


@pytest.mark.parametrize("fn", PREFILL, ids=lambda f: f.__name__)
@pytest.mark.parametrize("starts,lens,message", [
    ([0, 5, 37], [20, 33], "end at num_tokens"),
    ([1, 5, 38], [20, 33], "start at 0"),
    ([0, 30, 38], [20, 33], "30 new tokens but context_lens"),
    ([0, 5, 38], [20, 30], "block table too short|new tokens"),
])
def test_prefill_rejects_bad_layout(fn, starts, lens, message):
    inputs = prefill_inputs(query_start_loc=int32(starts), context_lens=int32(lens))
    with pytest.raises(ValueError, match=message):
        fn(*inputs.prefill_args())


def write_args(**changes):
    args = dict(k=torch.randn(3, 2, 64), v=torch.randn(3, 2, 64), k_cache=torch.zeros(4, 16, 2, 64),
                v_cache=torch.zeros(4, 16, 2, 64), slot_mapping=int32([0, -1, 63]))
    args.update(changes)
    return args


@pytest.mark.parametrize("fn", WRITE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("changes,error,message", [
    (dict(k=torch.randn(3, 2, 64).double()), TypeError, "k must have dtype"),
    (dict(v=torch.randn(3, 2, 64).half()), TypeError, "KV cache holds"),
    (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), TypeError, "slot_mapping must have dtype"),
    (dict(k=torch.randn(3, 128)), ValueError, "k must have rank 3"),
    (dict(k=torch.randn(3, 4, 64)), ValueError, "num_kv_heads"),
    (dict(slot_mapping=int32([0, 1])), ValueError, "num_tokens"),
])
def test_write_kv_rejects(fn, changes, error, message):
    with pytest.raises(error, match=message):
        fn(**write_args(**changes))


@pytest.mark.parametrize("slots", [[0, 1, 64], [0, -2, 5]])
def test_write_kv_rejects_slots_outside_cache(slots):
    with pytest.raises(ValueError, match="slot_mapping must hold -1"):
        kernels.write_kv(**write_args(slot_mapping=int32(slots)))
    with pytest.raises((ValueError, IndexError, RuntimeError)):
        kernels.write_kv_ref(**write_args(slot_mapping=int32(slots)))


def test_launchers_need_unit_stride_last_dim():
    inputs = decode_inputs()
    strided_q = torch.randn(2, 4, 128)[..., ::2]
    with pytest.raises(ValueError, match="stride 1 in its last dimension"):
        kernels.decode_attention(*dataclasses.replace(inputs, q=strided_q).decode_args())


def test_triton_entry_points_refuse_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(TypeError, match="decode_attention_ref"):
        kernels.decode_attention(*decode_inputs().decode_args())
    with pytest.raises(TypeError, match="write_kv_ref"):
        kernels.write_kv(**write_args())


def test_non_tensor_argument():
    inputs = decode_inputs()
    with pytest.raises(TypeError, match="block_tables must be a torch.Tensor"):
        kernels.decode_attention_ref(*dataclasses.replace(inputs, block_tables=[[0, 1]]).decode_args())
